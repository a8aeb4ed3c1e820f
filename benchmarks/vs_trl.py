"""rl-async against TRL's GRPOTrainer on the same cores, model, data and settings.

The peer a user would pick instead: TRL 1.16 `GRPOTrainer` (CPU, HF `generate`, one
process using every core), trained side by side with rl-async on the real SmolLM2-135M-Instruct
and the single-digit addition task of `cluster_configs/smollm2.toml`:

- same data (data/arith train rows; the first --eval-prompts rows of data/arith/eval.jsonl
  held out, never trained), same group size, prompts per update, lr and lr schedule (TRL's
  `cosine_with_min_lr` at min_lr_rate = rl-async's min_lr_ratio: the same formula), response
  length, sampling temperature 1, no KL term, one optimizer step per trained batch;
- the same glibc allocator setting in every training process (--allocator: rl-async's
  `cluster.cpu_allocator`, and the same mallopt call in TRL's process);
- the same evaluation: greedy responses to the held-out prompts every --every updates, scored
  by the same function (`rl_async.algo.tasks.final_answer` against the row's answer);
- time is the training loop's wall time with each side's evaluations taken out (TRL: the
  callback's seconds; rl-async: the summary's eval/seconds; rl-async evaluates with
  `eval.drain = true`, so an async pipeline that must refill after an evaluation pays for it);
- the order alternates per seed (even seeds run TRL first, odd seeds rl-async first).

rl-async runs in two modes, reported separately:
- "async" is rl-async as recommended (`smollm2.toml` as shipped): the zero-variance filter
  (dynamic sampling) regenerates groups whose rewards are all equal, so it GENERATES more
  samples per update than it trains; it trains the same number per update as TRL;
- "async_equal_work" turns the filter off: both sides generate and train the same samples
  per update, so the difference is the system's (async overlap, engine, trainer).
Per side: samples generated and trained per update, seconds per update, the held-out curve,
final reward, and the time to the target (TRL's median final held-out reward) over --seeds.
Goal: rl-async reaches the target >= 1.5x sooner by median (`meets_speed`) with a median
final reward at least TRL's median - 0.05 (`meets_learning`).

    pip install -e '.[bench]'       # TRL
    python benchmarks/vs_trl.py --json [--seeds 3] [--updates 15]
        [--modes async,async_equal_work,sync] [--allocator reuse|system]
        [--set KEY=VALUE ...]       # rl-async overrides (the TRL side keeps its settings)
prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (ROOT, curve_without_evals, finite, init_ray, load_checked,  # noqa: I001
                     speedup, TimedRun)  # (sets sys.path first)
from _smoke import parse_with_smoke  # noqa: E402

from rl_async.algo.tasks import final_answer  # noqa: E402
from rl_async.observe.compare import time_to  # noqa: E402

TRAIN = ROOT / "data" / "arith" / "train.jsonl"
EVAL = ROOT / "data" / "arith" / "eval.jsonl"
MODES = {"async": [], "async_equal_work": ["filter.zero_variance=false"],
         "sync": ["async.fully_async=false"]}


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def score(text: str, answer) -> float:
    """The reward both sides train and evaluate with (rl-async's answer_match_reward)."""
    return 1.0 if final_answer(text) == str(answer).strip() else 0.0


# ---------------------------------------------------------------- the TRL side (subprocess)

def trl_worker(args) -> None:
    """One TRL GRPO run; writes {"curve": [[update, train seconds, reward]], ...} to --result."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_async.state.prepare_model import prepare_model

    from rl_async.base.allocator import reuse_freed_memory

    if args.allocator == "reuse":  # what rl-async's actors apply (cluster.cpu_allocator)
        reuse_freed_memory()
    torch.set_num_threads(args.threads)
    model_dir = str(prepare_model("smollm2"))
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 local_files_only=True)
    train = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                "answer": r["answer"]} for r in rows(TRAIN)])
    held_out = rows(EVAL)[:args.eval_prompts]

    generated = [0]  # completions the trainer generated and scored (evaluation is apart)

    def reward(completions, answer, **_):
        generated[0] += len(completions)
        return [score(c[0]["content"], a) for c, a in zip(completions, answer)]

    def evaluate(m) -> float:
        tok.padding_side = "left"
        texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                         add_generation_prompt=True, tokenize=False)
                 for r in held_out]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        was_training = m.training
        m.eval()
        with torch.no_grad():
            out = m.generate(**enc, max_new_tokens=args.max_len, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        m.train(was_training)
        answers = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return statistics.fmean(score(t, r["answer"]) for t, r in zip(answers, held_out))

    class EvalEvery(TrainerCallback):
        """Greedy held-out reward every `every` updates; its seconds are taken out."""

        def __init__(self):
            self.curve, self.eval_seconds, self.start = [], 0.0, 0.0

        def _eval(self, step, m):
            t0 = time.monotonic()
            train_seconds = t0 - self.start - self.eval_seconds
            self.curve.append([step, round(train_seconds, 3), evaluate(m)])
            self.eval_seconds += time.monotonic() - t0

        def on_train_begin(self, a, state, control, model=None, **kw):
            self.start = time.monotonic()
            self._eval(0, model)

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % args.every == 0 or state.global_step == args.updates:
                self._eval(state.global_step, model)

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"), seed=args.seed, use_cpu=True,
        max_steps=args.updates, per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, max_completion_length=args.max_len,
        learning_rate=args.lr, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio}, warmup_steps=0,
        temperature=1.0, beta=0.0, max_grad_norm=1.0, weight_decay=0.0,
        save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0)
    callback = EvalEvery()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train,
                          processing_class=tok, callbacks=[callback])
    trainer.train()
    Path(args.result).write_text(json.dumps({
        "curve": callback.curve, "eval_seconds": callback.eval_seconds,
        # TRL trains every completion it generates (no filter)
        "generated_samples": generated[0], "trained_samples": generated[0]}))


def run_trl(seed: int, args) -> dict:
    result = Path(args.out) / f"trl-s{seed}.json"
    cmd = [sys.executable, __file__, "--trl-worker", "--result", str(result), "--seed", str(seed),
           *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SHARED]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the TRL run (seed {seed}) failed:\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


# ------------------------------------------------------------------------ the rl-async side

def run_rl_async(mode: str, seed: int, args) -> dict:
    overrides = [
        f"run.name=vs-trl-{mode}-s{seed}", f"run.seed={seed}", f"run.max_steps={args.updates}",
        f"run.output_dir={args.out}/runs", "wandb.mode=disabled",
        # absolute: the config's paths are relative to the repo, the benchmark runs from anywhere
        f"task.path={TRAIN}", f"task.eval_path={EVAL}",
        f"rollout.rollout_batch_size={args.prompts}", f"rollout.n_samples_per_prompt={args.group}",
        f"train.global_batch_size={args.prompts * args.group}",
        f"train.micro_batch_size={args.prompts * args.group}",
        f"rollout.max_response_len={args.max_len}", f"train.lr={args.lr}",
        "train.lr_schedule=cosine", f"train.min_lr_ratio={args.min_lr_ratio}",
        f"task.num_eval_prompts={args.eval_prompts}", f"eval.every_steps={args.every}",
        "eval.greedy=true", "eval.n_samples=0", "eval.drain=true",
        f"cluster.cpu_allocator={args.allocator}", *MODES[mode], *args.set]
    cfg, report = load_checked("cluster_configs/smollm2.toml", overrides)
    import ray

    result = ray.get(TimedRun.remote().run.remote(cfg, report.plan))
    curve, taken_out = curve_without_evals(result)
    summary = result["summary"]
    return {"curve": curve, "eval_seconds": taken_out, "summary": summary,
            "generated_samples": summary["rollout"]["generated_samples"],
            "trained_samples": summary["throughput"]["trained_samples"]}


# ------------------------------------------------------------------------------- the report

def side_report(runs: list[dict], target: float, updates: int) -> dict:
    finals = [r["curve"][-1][2] for r in runs]
    ttt = [time_to(r["curve"], target) for r in runs]
    ttt = [math.inf if t is None else t for t in ttt]
    per_update = [r["curve"][-1][1] / updates for r in runs]
    generated = [r["generated_samples"] / updates for r in runs]
    trained = [r["trained_samples"] / updates for r in runs]
    return {"seconds_per_update_median": round(statistics.median(per_update), 3),
            # the work per update: generated (and scored) vs trained samples
            "generated_samples_per_update": round(statistics.median(generated), 2),
            "trained_samples_per_update": round(statistics.median(trained), 2),
            "seconds_per_update": [round(x, 3) for x in per_update],
            "median_time_to_target_s": statistics.median(ttt), "time_to_target_s": ttt,
            "final_reward_median": statistics.median(finals), "final_rewards": finals,
            "curves": [r["curve"] for r in runs]}


def report(sides: dict[str, list[dict]], updates: int) -> dict:
    target = statistics.median(r["curve"][-1][2] for r in sides["trl"])
    out = {"target_reward": round(target, 4),
           "sides": {k: side_report(v, target, updates) for k, v in sides.items()}}
    trl = out["sides"]["trl"]
    for name, side in out["sides"].items():
        side["speedup"] = speedup(trl["median_time_to_target_s"], side["median_time_to_target_s"])
        side["final_minus_trl"] = round(side["final_reward_median"] - trl["final_reward_median"],
                                        4)
        # > 1: slower per update than TRL (both sides' evaluations taken out)
        side["seconds_per_update_vs_trl"] = round(
            side["seconds_per_update_median"] / trl["seconds_per_update_median"], 3)
        side["meets_speed"] = side["speedup"] >= 1.5
        side["meets_learning"] = side["final_minus_trl"] >= -0.05
    # Each rl-async mode's own figure, never the best of them: "async" is the recommended
    # settings (more generated per update), "async_equal_work" the same work as TRL.
    out["speedup"] = {k: round(v["speedup"], 3) for k, v in out["sides"].items() if k != "trl"}
    for side in out["sides"].values():  # JSON has no infinity: never reached -> null
        side["median_time_to_target_s"] = finite(side["median_time_to_target_s"])
        side["time_to_target_s"] = [finite(t) for t in side["time_to_target_s"]]
    return out



# Settings both sides take from the command line (passed on to the TRL worker).
SHARED = ("updates", "every", "prompts", "group", "max_len", "lr", "min_lr_ratio",
          "eval_prompts", "threads", "allocator")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--modes", default="async,async_equal_work",
                        help=f"rl-async modes: {sorted(MODES)}")
    parser.add_argument("--updates", type=int, default=15)
    parser.add_argument("--every", type=int, default=3, help="evaluate every N updates")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per update")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-len", type=int, default=12, help="response tokens")
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor")
    parser.add_argument("--eval-prompts", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="TRL's torch threads")
    parser.add_argument("--allocator", choices=("reuse", "system"), default="reuse",
                        help="glibc allocator setting of every training process, both sides")
    parser.add_argument("--out", default=None, help="where results go (default: temp dir)")
    parser.add_argument("--set", action="append", default=[], help="rl-async override")
    parser.add_argument("--reuse-trl", metavar="DIR", help="TRL results of an earlier run "
                        "with the same settings (its --out): rl-async runs only")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parse_with_smoke(parser, seeds=1, updates=2, every=1, prompts=2, group=2, max_len=4,
                            eval_prompts=4)
    if args.trl_worker:
        trl_worker(args)
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes {unknown}: use some of {sorted(MODES)}")
    args.out = args.out or tempfile.mkdtemp(prefix="rl-async-vs-trl-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    init_ray(num_cpus=2)
    started = time.monotonic()
    sides: dict[str, list[dict]] = {"trl": [], **{m: [] for m in modes}}
    for seed in range(args.seeds):
        order = ["trl", *modes] if seed % 2 == 0 else [*modes, "trl"]  # alternate who is first
        for side in order:
            if side == "trl":
                reused = Path(args.reuse_trl or "/nonexistent") / f"trl-s{seed}.json"
                sides["trl"].append(json.loads(reused.read_text()) if args.reuse_trl
                                    else run_trl(seed, args))
                continue
            sides[side].append(run_rl_async(side, seed, args))
            (Path(args.out) / f"{side}-s{seed}.json").write_text(
                json.dumps(sides[side][-1], default=str))
    result = report(sides, args.updates)
    result.update(seeds=args.seeds, updates=args.updates, out_dir=args.out,
                  allocator=args.allocator,
                  benchmark_seconds=round(time.monotonic() - started, 1))
    print(json.dumps(result, default=str) if args.json else json.dumps(result, indent=2,
                                                                        default=str))


if __name__ == "__main__":
    main()
