"""The embedded engine's two throughput features, each checked against a stock recomputation:
the prompt cache (a group's samples admitted in later steps copy their prompt's KV) and the
oneDNN linear layers (weights packed once). Both must follow every weight load."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl_async.engine.base import SamplingParams
from rl_async.engine.cpu_linear import pack_linears
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.engine.prefix_cache import PrefixCache
from rl_async.state.models import build_causal_lm, cache_kwarg, tiny_llama_config

torch.set_num_threads(1)

GROUP = [1, 5, 6, 7, 8, 9, 3]


def make_engine(**overrides) -> EmbeddedEngine:
    kwargs = {"hf_config": tiny_llama_config(), "max_running_requests": 2, "init_seed": 0,
              "onednn_linear": False}
    kwargs.update(overrides)
    return EmbeddedEngine(EmbeddedEngineConfig(**kwargs))


def stock_model(seed: int = 0):
    model = build_causal_lm(tiny_llama_config(), seed=seed)
    model.requires_grad_(False)
    return model


def expected_logprobs(model, prompt, output, temperature=1.0) -> torch.Tensor:
    """Log-probs of `output` after `prompt` from ONE stock forward (no cache, no engine)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logits = logits[len(prompt) - 1: len(prompt) - 1 + len(output)] / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


def count_prefills(engine) -> list[int]:
    """Rows of every prefill forward the engine runs (a decode feeds one token per row)."""
    cache_kwarg(engine.model)  # resolved off the real forward's signature, before the wrap
    rows, forward = [], engine.model.forward

    def counting(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            rows.append(ids.shape[0])
        return forward(*args, **kwargs)

    engine.model.forward = counting
    return rows


def run_group(engine, n: int = 4, seed0: int = 0, prompt=GROUP):
    async def run():
        return await asyncio.gather(*(
            engine.generate(prompt, SamplingParams(max_new_tokens=4 + i, temperature=1.0,
                                                   seed=seed0 + i))
            for i in range(n)))
    return asyncio.run(run())


@pytest.mark.parametrize("cache_tokens", [None, 0])
def test_samples_admitted_in_later_steps_share_one_prefill_and_stay_exact(cache_tokens):
    """Two slots, four samples of one prompt: the siblings are admitted as slots free up.
    With the cache the prompt is prefilled once (hits for the rest); without it, once per
    admission. Either way each sample's log-probs are those of a full stock forward."""
    engine = make_engine(prefix_cache_tokens=cache_tokens)
    prefills = count_prefills(engine)
    outs = run_group(engine)
    if cache_tokens == 0:
        assert len(prefills) > 1 and engine.stats["prefix_hits"] == 0
    else:
        assert prefills == [1]  # two admitted together share a row; the two later hit
        assert engine.stats["prefix_hits"] >= 1
    stock = stock_model()
    for out in outs:
        assert torch.allclose(torch.tensor(out.output_logprobs),
                              expected_logprobs(stock, GROUP, out.output_ids), atol=1e-4)


def test_a_weight_load_empties_the_prompt_cache():
    """After new weights, the same prompt is prefilled again and sampled under them: a stale
    cached KV or logit row would give the old model's log-probs."""
    engine = make_engine()
    run_group(engine, n=2)
    assert len(engine.prefix_cache) == 1
    new = stock_model(seed=7)
    asyncio.run(engine.update_weights_from_tensor(list(new.state_dict().items()), 1))
    assert len(engine.prefix_cache) == 0
    prefills = count_prefills(engine)
    outs = run_group(engine, n=2, seed0=10)
    assert prefills == [1]
    for out in outs:
        assert torch.allclose(torch.tensor(out.output_logprobs),
                              expected_logprobs(new, GROUP, out.output_ids), atol=1e-4)


def test_batch_invariant_tokens_do_not_depend_on_a_warm_prompt_cache():
    """run.deterministic: a seeded request gets the same bits whether its prompt was cached
    by an earlier request or prefilled afresh (every prefill there is a batch of one)."""
    cold = make_engine(batch_invariant=True)
    warm = make_engine(batch_invariant=True)
    run_group(warm, n=1, seed0=99)  # caches GROUP
    a = run_group(cold, n=3, seed0=0)
    b = run_group(warm, n=3, seed0=0)
    assert warm.stats["prefix_hits"] >= 1
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert [o.output_logprobs for o in a] == [o.output_logprobs for o in b]


def test_prefix_cache_bound_order_and_copies():
    cache = PrefixCache(max_tokens=5)
    kv = lambda n: [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))]  # noqa: E731
    cache.put((1, 2), kv(2), torch.zeros(3))
    cache.put((3, 4), kv(2), torch.zeros(3))
    assert cache.get((1, 2)) is not None  # now most recent
    cache.put((5, 6), kv(2), torch.zeros(3))  # 6 tokens > 5: the least recent goes
    assert cache.get((3, 4)) is None and cache.get((1, 2)) is not None
    assert cache.tokens == 4 and len(cache) == 2
    source = torch.ones(1, 2, 1, 4)
    cache.put((9,), [(source, source)], torch.zeros(3))
    source.zero_()  # the cache holds its own copy
    assert cache.get((9,)).kv[0][0].sum() == 8
    cache.put(tuple(range(6)), kv(6), torch.zeros(3))  # longer than the bound: not kept
    assert cache.get(tuple(range(6))) is None
    with pytest.raises(ValueError, match="KV of 2 positions for a prompt of 3"):
        cache.put((1, 2, 3), kv(2), torch.zeros(3))
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0


def test_onednn_linears_match_stock_and_follow_weight_loads():
    """Forced on (the tiny model is too small for the measurement to choose it): the engine's
    log-probs equal a stock forward, before and after a weight load (a packed copy of the old
    weights would keep the old model's numbers)."""
    engine = make_engine(onednn_linear=True, max_running_requests=4)
    assert engine.stats["onednn_linear"]
    outs = run_group(engine)
    stock = stock_model()
    for out in outs:
        assert torch.allclose(torch.tensor(out.output_logprobs),
                              expected_logprobs(stock, GROUP, out.output_ids), atol=1e-4)
    new = stock_model(seed=3)
    asyncio.run(engine.update_weights_from_tensor(list(new.state_dict().items()), 1))
    outs = run_group(engine, seed0=20)
    for out in outs:
        assert torch.allclose(torch.tensor(out.output_logprobs),
                              expected_logprobs(new, GROUP, out.output_ids), atol=1e-4)


def test_onednn_linear_setting():
    model = stock_model()
    assert pack_linears(model, torch.device("cpu"), False, rows=4) == (None, 0.0)
    packed, speedup = pack_linears(model, torch.device("cpu"), None, rows=4)
    assert speedup > 0  # measured, whichever way it went
    with pytest.raises(ValueError, match="engine.onednn_linear = true: not possible for "
                                         "parameters of dtype"):
        pack_linears(model.to(torch.bfloat16), torch.device("cpu"), True, rows=4)
    with pytest.raises(ValueError, match="engine.onednn_linear = true: not possible for device"):
        pack_linears(stock_model(), torch.device("meta"), True, rows=4)
    with pytest.raises(ValueError, match="engine.prefix_cache_tokens = -1"):
        make_engine(prefix_cache_tokens=-1)


MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_fast_decode_gives_the_stock_forwards_bits(model_type):
    """fast_decode.py runs the same modules without the stock forward's per-call Python: a
    seeded request gets exactly the same tokens and log-probs as through the stock forward."""
    config = tiny_llama_config(model_type=model_type)
    if model_type.startswith("qwen3"):  # per-head q/k norms; experts
        config.update({"head_dim": 16, **(MOE if model_type == "qwen3_moe" else {})})
    fast, stock = (make_engine(hf_config=config, max_running_requests=3) for _ in range(2))
    stock._fast = None
    assert fast.stats["fast_decode"] == "on" and fast._fast is not None
    prompts = [GROUP, [1, 9], [4, 4, 4, 4, 4, 4, 4, 4, 2]]

    def run(engine):
        async def go():
            return await asyncio.gather(*(
                engine.generate(p, SamplingParams(max_new_tokens=9, temperature=1.0, seed=i))
                for i, p in enumerate(prompts * 2)))
        return asyncio.run(go())

    a, b = run(fast), run(stock)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert [o.output_logprobs for o in a] == [o.output_logprobs for o in b]


def test_fast_decode_keeps_the_stock_forward_where_it_does_not_apply():
    from rl_async.engine.fast_decode import fast_decode_for

    model = build_causal_lm(tiny_llama_config(), attn_implementation="eager")
    assert fast_decode_for(model) == (None, "attention 'eager' (sdpa only)")
    assert fast_decode_for(torch.nn.Linear(2, 2))[1].startswith("model_type None")
