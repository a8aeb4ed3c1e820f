"""The embedded engine on a REAL pretrained model scores exactly what transformers'
greedy `generate` scores on the same held-out prompts (tokenizer, chat template, stop token,
decoding and reward all real)."""

import asyncio

import torch

from rl_async.plan.load import load_config
from rl_async.engine.base import SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.algo.stop_ids import stop_token_ids
from rl_async.algo.tasks import answer_match_reward, build_prompts, load_tokenizer
from rl_async.base.types import Sample
from real_model import smollm2_dir

N_PROMPTS = 8


def reward(tok, prompt, response_ids) -> float:
    sample = Sample(prompt.prompt_id, response_ids=list(response_ids),
                    metadata=dict(prompt.metadata))
    sample.metadata["response_text"] = tok.decode(response_ids, skip_special_tokens=True)
    return answer_match_reward(sample)


def test_engine_greedy_eval_equals_transformers_generate():
    torch.set_num_threads(2)
    cfg = load_config("cluster_configs/smollm2.toml", [f"model.path={smollm2_dir()}"])
    tok = load_tokenizer(cfg.model)
    prompts = build_prompts(cfg.task, len(tok), "eval", tok)[:N_PROMPTS]
    stop = stop_token_ids(cfg)
    assert stop == (tok.convert_tokens_to_ids("<|im_end|>"),)
    max_new = cfg.rollout.max_response_len
    engine = EmbeddedEngine(EmbeddedEngineConfig(path=cfg.model.path, max_running_requests=8))

    async def engine_outputs():
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=stop)
        outs = await asyncio.gather(*(engine.generate(p.prompt_ids, params) for p in prompts))
        await engine.close()
        return [o.output_ids for o in outs]

    ours = asyncio.run(engine_outputs())
    hf_model = engine.model
    theirs = []
    for p in prompts:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([p.prompt_ids]), max_new_tokens=max_new,
                                    do_sample=False, eos_token_id=list(stop),
                                    pad_token_id=tok.pad_token_id)
        theirs.append(out[0, len(p.prompt_ids):].tolist())
    # Same tokens (generate keeps the stop token, as the engine does) and so the same score.
    assert ours == theirs
    ours_r = [reward(tok, p, ids) for p, ids in zip(prompts, ours)]
    theirs_r = [reward(tok, p, ids) for p, ids in zip(prompts, theirs)]
    assert ours_r == theirs_r
    assert 0 < sum(ours_r) < len(prompts)  # a real model: some right, some wrong
