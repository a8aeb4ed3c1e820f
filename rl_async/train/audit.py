"""The provenance audit (`run.audit_fraction`): does a trained token come from the weights
of the version it claims?

Trainer rank 0 keeps the last few PUBLISHED snapshots on the host (`keep`). For a sampled
fraction of each collection's samples it replays the engine's own computation under the
weights of each token's claimed version and compares the log-prob with the behaviour
log-prob the engine recorded:

    per sampled token, in order:
      a context token (loss_mask 0: an environment's turn) extends the context; the next
      sampled token needs a fresh prefill
      a sampled token whose version differs from the one loaded (a mixed-policy refresh:
      its prefix was rebuilt under the new weights) or that follows a context token:
      load that version's weights, prefill the whole context as a batch of one
      otherwise: decode the previous token (a batch of one)
      then log_softmax(logits / temperature)[token] against the recorded log-prob

That is the embedded engine's batch-invariant path (rl_async/engine/kv_batch.py:
`prefill_isolated`, `decode_isolated`; rl_async/engine/sampling.py), with the engine's
thread count: under `run.deterministic` on CPU the numbers are the engine's bit for bit,
so the tolerance is 0 and any difference is a mislabelled token, stale KV (a prompt cache
kept across a weight load) or half-updated weights. Elsewhere batching and kernels differ
by rounding, and the tolerance says how much is rounding. A token whose version's snapshot
is no longer kept is counted `unverifiable`, not audited.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import torch

from rl_async.engine.kv_batch import decode_isolated, prefill_isolated
from rl_async.engine.scheduler import Request
from rl_async.base.types import Group, Sample
from rl_async.engine.base import SamplingParams
from rl_async.state.models import build_causal_lm
from rl_async.state.weights import unflatten_bucket

# Default tolerances (run.audit_tolerance unset) where the numbers cannot be bit-exact: what
# batching and kernel choice change in a log-prob, by the dtype the engines serve.
ROUNDING_TOLERANCE = {"float32": 1e-3, "float64": 1e-6}
LOW_PRECISION_TOLERANCE = 5e-2  # bf16 / fp16


def audit_tolerance(cfg) -> float:
    """run.audit_tolerance, or its default: 0 under run.deterministic on CPU engines."""
    if cfg.run.audit_tolerance is not None:
        return cfg.run.audit_tolerance
    if cfg.run.deterministic and not cfg.cluster.inference_gpus:
        return 0.0
    return ROUNDING_TOLERANCE.get(cfg.model.dtype, LOW_PRECISION_TOLERANCE)


class ProvenanceAudit:
    def __init__(self, hf_config: dict, dtype: str, fraction: float, tolerance: float,
                 keep_versions: int, temperature: float, seed: int, threads: int | None,
                 path: str | None = None, device: str = "cpu"):
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"run.audit_fraction = {fraction!r}: in (0, 1] to audit")
        self.hf_config, self.dtype, self.path, self.device = hf_config, dtype, path, device
        self.fraction, self.tolerance, self.temperature = fraction, tolerance, temperature
        self.keep_versions, self.threads = keep_versions, threads
        self.rng = random.Random(seed)
        self.snapshots: OrderedDict[int, list[tuple[torch.Tensor, tuple]]] = OrderedDict()
        self._model = None
        self._params: dict[str, torch.nn.Parameter] = {}
        self._loaded: int | None = None
        self.totals = {"audited_tokens": 0, "mismatches": 0, "max_abs_diff": 0.0,
                       "unverifiable_tokens": 0}

    def keep(self, version: int, buckets: list[torch.Tensor], metas: list[tuple]
             ) -> list[torch.Tensor]:
        """A published snapshot (flat host buckets and their metas), by reference: the
        sender does not reuse them while they are kept (PublicationSender.retain_published).
        Returns the buffers of the snapshots dropped beyond `keep_versions`, free again."""
        self.snapshots[version] = [(b.detach(), m[:3]) for b, m in zip(buckets, metas)]
        self.snapshots.move_to_end(version)
        freed = []
        while len(self.snapshots) > self.keep_versions:
            dropped, kept = self.snapshots.popitem(last=False)
            freed += [b for b, _ in kept]
            if dropped == self._loaded:
                self._loaded = None
        return freed

    def audit(self, groups: list[Group]) -> dict[str, float]:
        """Audit a sampled fraction of these groups' samples; this collection's figures
        (`provenance/*`), also added to `totals`."""
        window = {"audited_tokens": 0, "mismatches": 0, "max_abs_diff": 0.0,
                  "unverifiable_tokens": 0}
        chosen = [s for g in groups for s in g.samples
                  if s.response_ids and self.rng.random() < self.fraction]
        if chosen:
            previous = torch.get_num_threads()
            if self.threads:  # the engine's: a thread count changes how reductions split
                torch.set_num_threads(self.threads)
            try:
                with torch.inference_mode():
                    for sample in sorted(chosen, key=lambda s: s.oldest_version() or 0):
                        self._replay(sample, window)
            finally:
                torch.set_num_threads(previous)
        for key in ("audited_tokens", "mismatches", "unverifiable_tokens"):
            self.totals[key] += window[key]
        self.totals["max_abs_diff"] = max(self.totals["max_abs_diff"], window["max_abs_diff"])
        return {f"provenance/{k}": float(v) for k, v in window.items()}

    def summary(self) -> dict:
        return {**self.totals, "tolerance": self.tolerance}

    # ---- the replay ------------------------------------------------------------------------
    def _replay(self, sample: Sample, window: dict) -> None:
        mask = sample.loss_mask or [1] * len(sample.response_ids)
        context = list(sample.prompt_ids)
        request, batch, version = None, None, None
        for token, v, recorded, sampled in zip(sample.response_ids, sample.token_versions,
                                               sample.behavior_logprobs, mask):
            if not sampled or v not in self.snapshots:
                window["unverifiable_tokens"] += bool(sampled)
                context.append(token)
                request = None
                continue
            if request is None or v != version:
                self._load(v)
                request = Request("audit", list(context), SamplingParams(), None, None)
                batch, logits_BV = prefill_isolated(self._model, [request], self.device)
                version = v
            else:
                logits_BV = decode_isolated(self._model, batch)
            logprob = self._logprob(logits_BV, token)
            diff = abs(logprob - recorded)
            window["audited_tokens"] += 1
            window["mismatches"] += diff > self.tolerance
            window["max_abs_diff"] = max(window["max_abs_diff"], diff)
            request.output_ids.append(token)
            context.append(token)

    def _logprob(self, logits_BV: torch.Tensor, token: int) -> float:
        """The engine's recorded quantity (rl_async/engine/sampling.py `sample_tokens`):
        log_softmax(logits / temperature) over the full vocabulary; temperature 0 means 1."""
        temperature = torch.tensor([self.temperature if self.temperature > 0 else 1.0],
                                   dtype=torch.float32, device=logits_BV.device)
        logprobs_BV = torch.log_softmax(logits_BV.float() / temperature[:, None], dim=-1)
        return float(logprobs_BV[0, token])

    def _load(self, version: int) -> None:
        if self._loaded == version:
            return
        if self._model is None:
            self._model = build_causal_lm(self.hf_config, self.path, 0, self.dtype,
                                          self.device)
            self._model.requires_grad_(False)
            self._params = dict(self._model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for flat, meta in self.snapshots[version]:
                for name, tensor in unflatten_bucket(flat, *meta):
                    self._params[name].copy_(tensor)
        self._loaded = version
