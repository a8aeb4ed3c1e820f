"""Embedded continuous-batching engine vs transformers' static-batch `generate`.

Same model, same prompts, same per-request response lengths drawn from a long-tailed
(lognormal) distribution, measured in one run. The workload is RL's: groups of `--group`
samples of one prompt (each its own length), sent together, as a producer does; HF
`generate` gets the same rows in the same order (prompts repeated, as TRL's GRPOTrainer
batches them). `--model smollm2` uses the real SmolLM2-135M-Instruct (prepared offline by
`rl-async prepare-model smollm2`) instead of the tiny random Llama. `generate` cannot retire rows early, so a
static batch runs until its longest request; both sides are credited ONLY with useful tokens
(each request's own length), which is what an RL producer gets. Sampling at temperature 1;
stop tokens are disabled on both sides so lengths are exactly the drawn ones.

Both sides get the same glibc allocator setting (`--allocator`, default `reuse`: what the
engine's actor applies, rl_async/base/allocator.py): the engine in this process, HF `generate`
in a child process of its own with its stock copy of the weights. The engine's prompt cache
is emptied before every round, as every weight load empties it in RL: only a group's samples
admitted in the same round share their prompt's prefill (`prefix_hits_per_round`).
"ratio_same_kernels" runs HF on the engine's model in the engine's process (same kernels):
what continuous batching and the prompt cache give alone.

    python benchmarks/engine_throughput.py --json [--model smollm2] [--repeat N]
prints one JSON line {"embedded_tokens_per_s", "hf_generate_tokens_per_s", "ratio", ...}, and
the same engine in batch-invariant mode (run.deterministic): "batch_invariant_fraction" is the
throughput it keeps, "batch_invariant_vs_hf" its ratio to HF generate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time

import torch

from _smoke import parse_with_smoke
from rl_async.base.allocator import reuse_freed_memory
from rl_async.engine.base import SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.state.models import build_causal_lm, tiny_llama_config


def make_workload(n: int, seed: int, vocab: int, max_len: int, group: int = 1
                  ) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    while len(work) < n:
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))]
        for _ in range(min(group, n - len(work))):
            # lognormal(median ~24, heavy tail), clipped: most short, a few very long.
            length = int(min(max_len, max(4, rng.lognormvariate(3.2, 0.9))))
            work.append((prompt, length))
    return work


async def run_embedded(engine: EmbeddedEngine, work) -> tuple[float, int]:
    start = time.perf_counter()
    outs = await asyncio.gather(*(
        engine.generate(prompt, SamplingParams(max_new_tokens=length, seed=i))
        for i, (prompt, length) in enumerate(work)))
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.output_ids) for o in outs)


def run_hf_generate(model, work, batch_size: int) -> tuple[float, int, int]:
    useful, computed = 0, 0
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        batch = work[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        longest = max(length for _, length in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=longest,
                                 min_new_tokens=longest, eos_token_id=None, pad_token_id=0)
        computed += (out.shape[1] - width) * len(batch)
        useful += sum(length for _, length in batch)  # each row's own length only
    return time.perf_counter() - start, useful, computed


_stock = None  # the child process's HF model


def _stock_init(hf_config, path, threads: int, allocator: str) -> None:
    global _stock
    if allocator == "reuse":  # the same setting as the engine's process
        reuse_freed_memory()
    torch.set_num_threads(threads)
    _stock = build_causal_lm(hf_config, path)
    _stock.requires_grad_(False)


def _stock_run(work, batch_size: int) -> tuple[float, int, int]:
    return run_hf_generate(_stock, work, batch_size)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="max_running = static batch size")
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (RL group)")
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--allocator", choices=("reuse", "system"), default="reuse",
                        help="glibc allocator setting of both sides' processes")
    parser.add_argument("--repeat", type=int, default=None,
                        help="interleaved rounds, median of each side (default 3 tiny, 1 smollm2)")
    args = parse_with_smoke(parser, requests=8, batch=4, max_len=16)
    if args.repeat is None:
        args.repeat = 3 if args.model == "tiny" else 1
    return args


def model_spec(name: str) -> tuple[dict, int]:
    """(EmbeddedEngineConfig's model keys, vocabulary size) of --model."""
    if name == "smollm2":
        from rl_async.state.prepare_model import prepare_model

        return {"path": str(prepare_model("smollm2"))}, 49152
    return {"hf_config": tiny_llama_config(vocab_size=512, hidden_size=128, num_layers=2,
                                           max_position_embeddings=512)}, 512


def measure(args, engine, invariant, stock, work) -> dict:
    """--repeat interleaved rounds, each side from a cold prompt cache; per side the round
    seconds, and the useful tokens and prefix hits of the rounds."""
    rounds: dict[str, list[float]] = {"emb": [], "hf": [], "same": [], "inv": [], "hits": []}
    for _ in range(args.repeat):
        for e in (engine, invariant):  # a cold prompt cache, as after every weight load
            asyncio.run(e.flush_cache())
        hits = engine.stats["prefix_hits"]
        seconds, rounds["emb_tokens"] = asyncio.run(run_embedded(engine, work))
        rounds["hits"].append(engine.stats["prefix_hits"] - hits)
        rounds["emb"].append(seconds)
        seconds, rounds["hf_tokens"], rounds["hf_computed"] = stock.apply(
            _stock_run, (work, args.batch))
        rounds["hf"].append(seconds)
        # the same static batches on the engine's kernels: the scheduling's share of the ratio
        rounds["same"].append(run_hf_generate(engine.model, work, args.batch)[0])
        seconds, rounds["inv_tokens"] = asyncio.run(run_embedded(invariant, work))
        rounds["inv"].append(seconds)
    return rounds


def report(args, rounds: dict, engine, allocator: str) -> dict:
    emb_s, hf_s, same_s, inv_s = (statistics.median(rounds[k])
                                  for k in ("emb", "hf", "same", "inv"))
    emb_tokens, hf_tokens, inv_tokens = (rounds[k] for k in ("emb_tokens", "hf_tokens",
                                                             "inv_tokens"))
    if emb_tokens != hf_tokens:
        raise SystemExit(f"useful token counts differ: embedded {emb_tokens} vs hf {hf_tokens}")
    return {
        "embedded_tokens_per_s": round(emb_tokens / emb_s, 1),
        "hf_generate_tokens_per_s": round(hf_tokens / hf_s, 1),
        "ratio": round((emb_tokens / emb_s) / (hf_tokens / hf_s), 3),
        "round_ratios": [round(h / e, 3) for e, h in zip(rounds["emb"], rounds["hf"])],
        # HF generate on the engine's own kernels: what continuous batching and the prompt
        # cache give alone; ratio / this is what the oneDNN linears give
        "ratio_same_kernels": round(same_s / emb_s, 3),
        "hf_same_kernels_seconds": round(same_s, 2),
        "onednn_linear": engine.stats["onednn_linear"],
        "engine_allocator": allocator,
        # siblings admitted after their prompt's prefill, per round (the cache starts empty)
        "prefix_hits_per_round": rounds["hits"],
        "batch_invariant_tokens_per_s": round(inv_tokens / inv_s, 1),
        # throughput kept by run.deterministic, and its standing against HF generate
        "batch_invariant_fraction": round((inv_tokens / inv_s) / (emb_tokens / emb_s), 3),
        "batch_invariant_vs_hf": round((inv_tokens / inv_s) / (hf_tokens / hf_s), 3),
        "useful_tokens": emb_tokens, "hf_useful_tokens": hf_tokens,
        "hf_computed_tokens": rounds["hf_computed"],
        "embedded_seconds": round(emb_s, 2), "hf_seconds": round(hf_s, 2),
        "requests": args.requests, "repeat": args.repeat, "group": args.group,
        "model": args.model, "max_running_requests": args.batch,
        "engine_steps": engine.load().extra["steps"],
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    allocator = reuse_freed_memory() if args.allocator == "reuse" else "system"
    model, vocab = model_spec(args.model)
    engine = EmbeddedEngine(EmbeddedEngineConfig(
        **model, max_running_requests=args.batch, torch_threads=args.threads))
    # run.deterministic: the same engine decoding batch-invariantly (one forward per row).
    invariant = EmbeddedEngine(EmbeddedEngineConfig(
        **model, max_running_requests=args.batch, torch_threads=args.threads,
        batch_invariant=True))
    work = make_workload(args.requests, args.seed, vocab, args.max_len, args.group)
    # HF generate as a user runs it: its own stock copy of the same weights (the engine's
    # model runs its linear layers through oneDNN, rl_async/engine/cpu_linear.py), in a
    # process of its own with the same allocator setting.
    stock = multiprocessing.get_context("spawn").Pool(
        1, _stock_init, (model.get("hf_config"), model.get("path"), args.threads,
                         args.allocator))
    warm = [(p, 4) for p, _ in work[: args.batch // 2]]  # warm-ups, not measured
    for e in (engine, invariant):
        asyncio.run(run_embedded(e, warm))
    stock.apply(_stock_run, (warm, args.batch))
    run_hf_generate(engine.model, warm, args.batch)
    try:
        result = report(args, measure(args, engine, invariant, stock, work), engine, allocator)
    finally:
        stock.close()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
