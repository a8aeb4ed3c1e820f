"""The provenance audit (rl_async/train/audit.py) against the embedded engine's real outputs:
under batch-invariant decoding the replay gives the engine's log-probs bit for bit, also
across a mixed-policy refresh (a prefix rebuilt under new weights mid-response); weights
other than the claimed version's are caught; unkept versions are unverifiable."""

from __future__ import annotations

import asyncio

import torch

from rl_async.base.types import Group, Sample
from rl_async.engine.base import SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.state.models import build_causal_lm, tiny_llama_config
from rl_async.state.weights import bucket_named_tensors, flatten_bucket
from rl_async.train.audit import ProvenanceAudit

torch.set_num_threads(1)
CONFIG = tiny_llama_config()
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6], [1, 2, 3]]


def snapshot(named) -> tuple[list[torch.Tensor], list[tuple]]:
    """Flat buckets and metas of these weights, as trainer rank 0 publishes them."""
    buckets, metas = [], []
    for bucket in bucket_named_tensors([(n, t.detach()) for n, t in named], 20_000):
        flat, names, dtypes, shapes = flatten_bucket(bucket)
        buckets.append(flat)
        metas.append((names, dtypes, shapes, flat.numel()))
    return buckets, metas


def audit(fraction=1.0, tolerance=0.0) -> ProvenanceAudit:
    return ProvenanceAudit(CONFIG, "float32", fraction, tolerance, keep_versions=4,
                           temperature=1.0, seed=0, threads=1)


def sample(prompt, out) -> Sample:
    return Sample("p", response_ids=out.output_ids, token_versions=out.token_versions,
                  behavior_logprobs=out.output_logprobs, prompt_ids=prompt)


def generate(engine, mid_response_update=None):
    """Four seeded responses at once; `mid_response_update(engine)` runs while they are
    in flight (a mixed-policy refresh)."""
    async def main():
        calls = [asyncio.ensure_future(engine.generate(p, SamplingParams(
            max_new_tokens=12, temperature=1.0, seed=i))) for i, p in enumerate(PROMPTS)]
        if mid_response_update is not None:
            while engine.stats["steps"] < 3:
                await asyncio.sleep(0.001)
            await mid_response_update(engine)
        outs = await asyncio.gather(*calls)
        await engine.close()
        return outs
    return asyncio.run(main())


def test_the_replay_is_bit_exact_under_batch_invariant_decoding_and_catches_other_weights():
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=CONFIG, max_running_requests=4,
                                                 batch_invariant=True, init_seed=3))
    outs = generate(engine)
    groups = [Group("g", [sample(p, o) for p, o in zip(PROMPTS, outs)])]
    tokens = sum(len(o.output_ids) for o in outs)

    honest = audit()
    honest.keep(0, *snapshot(engine.model.named_parameters()))
    got = honest.audit(groups)
    assert got["provenance/audited_tokens"] == tokens > 0
    assert got["provenance/mismatches"] == 0 and got["provenance/max_abs_diff"] == 0.0

    wrong = audit()  # the claimed version's weights are not what sampled the tokens
    wrong.keep(0, *snapshot(build_causal_lm(CONFIG, seed=4).named_parameters()))
    assert wrong.audit(groups)["provenance/mismatches"] == tokens

    unkept = audit()
    unkept.keep(7, *snapshot(engine.model.named_parameters()))
    got = unkept.audit(groups)
    assert got["provenance/audited_tokens"] == 0
    assert got["provenance/unverifiable_tokens"] == tokens


def test_a_mixed_policy_refresh_replays_each_span_under_its_own_version():
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=CONFIG, max_running_requests=4,
                                                 batch_invariant=True, init_seed=3))
    v0 = snapshot(engine.model.named_parameters())
    new = list(build_causal_lm(CONFIG, seed=5).named_parameters())

    async def refresh(e):  # retract, load version 1, continue: prefixes rebuilt under it
        await e.pause_generation("retract")
        await e.update_weights_from_tensor([(n, p.detach()) for n, p in new], 1)
        await e.continue_generation()

    outs = generate(engine, refresh)
    assert any(0 in o.token_versions and 1 in o.token_versions for o in outs)
    groups = [Group("g", [sample(p, o) for p, o in zip(PROMPTS, outs)])]
    checker = audit()
    checker.keep(0, *v0)
    checker.keep(1, *snapshot(new))
    got = checker.audit(groups)
    assert got["provenance/audited_tokens"] == sum(len(o.output_ids) for o in outs)
    assert got["provenance/mismatches"] == 0, got
    assert checker.summary()["tolerance"] == 0.0


def test_the_fraction_samples_and_the_totals_add_up():
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=CONFIG, max_running_requests=4,
                                                 batch_invariant=True, init_seed=3))
    outs = generate(engine)
    groups = [Group(f"g{i}", [sample(p, o) for p, o in zip(PROMPTS, outs)]) for i in range(25)]
    half = audit(fraction=0.5)
    half.keep(0, *snapshot(engine.model.named_parameters()))
    audited = half.audit(groups)["provenance/audited_tokens"]
    total = 25 * sum(len(o.output_ids) for o in outs)
    assert 0.3 * total < audited < 0.7 * total
    assert half.summary()["audited_tokens"] == audited
