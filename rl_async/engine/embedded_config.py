"""Settings of one embedded engine (rl_async/engine/embedded.py), validated on construction.
Split out to keep the engine file small; `EmbeddedEngineConfig` is imported from
`rl_async.engine.embedded` as before."""

from __future__ import annotations

from dataclasses import dataclass

from rl_async.state.models import resolve_dtype


@dataclass
class EmbeddedEngineConfig:
    """Settings of one embedded engine. Model: exactly one of `hf_config` / `path`."""

    hf_config: dict | None = None
    path: str | None = None
    init_seed: int = 0  # weights seed for hf_config; the trainer uses the same
    device: str = "cpu"
    dtype: str = "float32"
    attn_implementation: str | None = None
    max_running_requests: int = 32
    max_total_tokens: int | None = None  # None -> max_running_requests * context_len
    context_len: int | None = None  # None -> the model's max_position_embeddings
    max_prompt_len: int | None = None  # None -> context_len - 1
    # Prompt KV kept for a group's later-admitted samples (rl_async/engine/prefix_cache.py),
    # in tokens: None -> a quarter of max_total_tokens, 0 -> off.
    prefix_cache_tokens: int | None = None
    # Linear layers through oneDNN on weights packed once (rl_async/engine/cpu_linear.py):
    # None -> on where supported (CPU, float32) and measured clearly faster at start (stock
    # under batch_invariant: no timing decides a reproducible run's kernel), True ->
    # required, False -> torch's F.linear.
    onednn_linear: bool | None = None
    torch_threads: int | None = None  # None -> leave torch's setting alone
    sampling_seed: int = 0  # seeds requests whose SamplingParams.seed is None
    forward_in_thread: bool = True  # False: forwards block the loop (benchmarks, debugging)
    # One forward (and one draw) per request: its tokens and log-probs are those it gets alone,
    # whatever shares its step (run.deterministic; costs throughput, README "Reproducibility").
    batch_invariant: bool = False
    # A request not answered within this aborts and raises TransientEngineError (its group is
    # regenerated): sglang.request_timeout_s, which both engines honour. None: no deadline.
    request_timeout_s: float | None = None
    # MoE routing replay (train.routing_replay): record the experts chosen at every fed token
    # and return them with the reply (rl_async/state/moe_routing.py).
    record_routing: bool = False
    # Tests only: pick the top-k from probabilities plus noise of this scale (near-tie flips).
    routing_perturb: float = 0.0

    def __post_init__(self) -> None:
        if (self.hf_config is None) == (self.path is None):
            raise ValueError("EmbeddedEngineConfig: set exactly one of hf_config / path "
                             f"(got hf_config={self.hf_config!r}, path={self.path!r})")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"engine.device = {self.device!r}: use 'cpu', 'cuda' or 'cuda:N'")
        resolve_dtype(self.dtype)
        if self.prefix_cache_tokens is not None and (
                not isinstance(self.prefix_cache_tokens, int) or self.prefix_cache_tokens < 0):
            raise ValueError(f"engine.prefix_cache_tokens = {self.prefix_cache_tokens!r}: must "
                             f"be an int >= 0 (0 turns the prompt cache off)")
        for key in ("max_running_requests", "max_total_tokens", "context_len",
                    "max_prompt_len", "torch_threads"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"engine.{key} = {value!r}: must be an int >= 1")


def check_fits(input_ids: list[int], params, *, max_prompt_len: int, vocab_size: int,
               context_len: int, max_total_tokens: int) -> None:
    """A request this engine can hold: prompt length, token ids inside the vocabulary, and
    prompt + max_new_tokens within the model's context and the engine's KV budget; raises
    InvalidRequestError naming the field and the limit."""
    from rl_async.engine.base import InvalidRequestError

    if len(input_ids) > max_prompt_len:
        raise InvalidRequestError(
            f"input_ids: prompt length {len(input_ids)} exceeds max_prompt_len = "
            f"{max_prompt_len}; shorten the prompt or raise rollout.max_prompt_len")
    for key, ids in (("input_ids", input_ids), ("sampling_params.stop_token_ids",
                                                params.stop_token_ids)):
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"{key}: token ids {bad[:5]!r} outside the vocabulary "
                                      f"[0, {vocab_size})")
    if len(input_ids) + params.max_new_tokens > context_len:
        raise InvalidRequestError(
            f"sampling_params.max_new_tokens = {params.max_new_tokens}: prompt "
            f"({len(input_ids)}) + max_new_tokens exceeds context_len = {context_len}")
    if len(input_ids) + params.max_new_tokens > max_total_tokens:
        raise InvalidRequestError(
            f"sampling_params.max_new_tokens = {params.max_new_tokens}: prompt + "
            f"max_new_tokens exceeds engine.max_total_tokens = {max_total_tokens}; raise it "
            f"or shorten the request")
