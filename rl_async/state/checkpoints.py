"""Run directories and checkpoints that are complete or absent (resume: `rl-async run --resume`).

    <run.output_dir>/<run.name>/
        run-20261203-091500/               one directory per run; a resumed run continues in it
            .step_000040.partial/          being written: trainer ranks, the HF export ...
            step_000040/                   renamed from .partial once meta.json is in it
                meta.json                  step, policy version, config, ledger (written last)
                trainer_state.pt | megatron_rank*/      model, optimizer, step, RNG states
                hf/                        the policy as a Hugging Face directory
            latest                         "step_000040", replaced after the rename
            trained.jsonl                  per optimizer step: the groups it trained

A reader never sees a half-written checkpoint: everything goes into `.partial`, meta.json is
written last inside it, then one rename publishes it and `latest` moves after that. Resume
skips anything without meta.json. Running the same config twice without `--resume` starts a
new run directory, so two runs never mix checkpoints and nothing is deleted silently;
`--resume` picks the newest run directory that holds a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

META = "meta.json"
LATEST = "latest"
TRAINED_LOG = "trained.jsonl"
RUN_PREFIX = "run-"

# Changing these makes a checkpoint meaningless: other weights or optimizer shapes, another
# group size, another prompt stream (the ledger's cursors index it).
BREAKING_KEYS = ("model.hf_config", "model.path", "rollout.n_samples_per_prompt",
                 "train.backend", "train.tensor_parallel", "train.pipeline_parallel",
                 "task.name", "task.path", "task.modulus", "task.prompt_digits", "run.seed")


# Keys that shape the training prompt list besides the BREAKING ones: the held-out split and
# the sources that build rows (reasoning-gym, verifiers, environments).
STREAM_KEYS = ("task.eval_path", "task.num_eval_prompts", "task.dataset", "task.dataset_config",
               "task.env", "task.env_args", "task.count_tokens")


class ResumeError(RuntimeError):
    """No usable checkpoint, or a config change that the checkpoint cannot survive."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def new_run_dir(output_dir: str | os.PathLike, name: str) -> Path:
    root = Path(output_dir) / name
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for k in range(1000):
        candidate = root / (RUN_PREFIX + stamp + (f"-{k}" if k else ""))
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a new run directory under {root}")


def staging_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / f".{step_name(step)}.partial"


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def finalize(run_dir: str | os.PathLike, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Publish the staged checkpoint of `step`: meta.json last inside it, rename, move
    `latest`, then keep the newest `keep` complete checkpoints (0 keeps all)."""
    run_dir = Path(run_dir)
    staged, final = staging_dir(run_dir, step), run_dir / step_name(step)
    _write_json_atomic(staged / META, {"step": step, **meta})
    if final.exists():  # the same step again (a resumed run that trained nothing new)
        shutil.rmtree(final)
    os.replace(staged, final)
    _write_json_atomic(run_dir / LATEST, step_name(step))
    for leftover in run_dir.glob(".step_*.deleting"):  # a crash mid-prune: finish it
        shutil.rmtree(leftover)
    if keep:
        for old in complete_checkpoints(run_dir)[:-keep]:
            remove_checkpoint(old)
    return final


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that a crash midway never leaves one that looks complete: it is
    first renamed out of the `step_*` namespace (one atomic rename), then deleted (a leftover
    `.deleting` directory is finished off by the next finalize)."""
    doomed = path.with_name(f".{path.name}.deleting")
    os.replace(path, doomed)
    shutil.rmtree(doomed)


def abandon_later_checkpoints(run_dir: str | os.PathLike, step: int) -> list[Path]:
    """A run resumed from `step` continues a new lineage: complete checkpoints of later steps
    (from the run it resumed, e.g. `--resume` of an older checkpoint) are set aside as
    `abandoned-step_*` so that neither pruning nor a later `--resume` mistakes them for the
    newest of this lineage. Returns where they went (kept, not deleted)."""
    moved = []
    for later in complete_checkpoints(run_dir):
        if int(later.name.split("_")[1]) > step:
            target = later.with_name(f"abandoned-{later.name}")
            os.replace(later, target)
            moved.append(target)
    return moved


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of one run, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.glob("step_*") if (p / META).is_file())


def _latest_in_run(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: the scan decides (a crash between a checkpoint's rename
    and the pointer's update leaves `latest` one behind); `latest` is a hint for readers."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def find_checkpoint(output_dir: str | os.PathLike, name: str,
                    path: str | os.PathLike | None = None) -> Path:
    """The checkpoint to resume: `path` (a checkpoint or a run directory), else the latest
    complete checkpoint of the newest run under `<output_dir>/<name>` that has one."""
    if path is not None:
        p = Path(path)
        if (p / META).is_file():
            return p
        found = _latest_in_run(p) if p.is_dir() else None
        if found is None:
            raise ResumeError(f"--resume {p}: not a complete checkpoint (no {META}) nor a run "
                              f"directory holding one")
        return found
    root = Path(output_dir) / name
    runs = sorted((d for d in root.glob(RUN_PREFIX + "*") if d.is_dir()), reverse=True)
    for run_dir in runs:
        found = _latest_in_run(run_dir)
        if found is not None:
            return found
    raise ResumeError(f"--resume: no complete checkpoint under {root} (run.output_dir = "
                      f"{str(output_dir)!r}, run.name = {name!r}); run without --resume to "
                      f"start, or pass --resume PATH")


def load_meta(checkpoint: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / META).read_text())


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def incompatible_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Config changes a resume refuses, each naming the key, the old and the new value."""
    keys = list(BREAKING_KEYS)
    if _get(now, "train.backend") == "megatron":  # per-rank shards of one layout
        keys.append("cluster.trainer_workers")
    if _get(now, "task.name") != "successor":  # the built-in task's keys mean nothing else
        keys = [k for k in keys if k not in ("task.modulus", "task.prompt_digits")]
    return [f"{k} = {_get(now, k)!r} but the checkpoint was written with {_get(saved, k)!r}"
            for k in keys if _get(saved, k) != _get(now, k)]


def stream_change(saved_config: dict[str, Any], now_config: dict[str, Any],
                  saved_digest: str | None, now_digest: str) -> str | None:
    """Why a resume cannot continue the checkpoint's prompt stream, or None when the training
    prompt list is the one the ledger's cursors were written against (`saved_digest`;
    rl_async.algo.tasks.stream_digest). A checkpoint written before digests is not checked."""
    if saved_digest is None or saved_digest == now_digest:
        return None
    changed = [f"{k} = {_get(now_config, k)!r} (the checkpoint has {_get(saved_config, k)!r})"
               for k in (*BREAKING_KEYS, *STREAM_KEYS)
               if _get(saved_config, k) != _get(now_config, k)]
    cause = ("; ".join(changed) if changed else
             "no key changed, so the data behind task.path / task.eval_path changed on disk")
    return (f"the training prompt list differs from the checkpoint's (digest {now_digest} vs "
            f"{saved_digest}): {cause}. The ledger's cursors index that list, so some prompts "
            f"would train twice and others never (held-out rows could move into training); "
            f"restore the setting or the files, or start a new run without --resume")


def trim_trained_log(run_dir: str | os.PathLike, step: int) -> None:
    """A resumed run drops the log entries of steps after its checkpoint: those updates
    were lost with the crash, and their prompts are trained again."""
    log = Path(run_dir) / TRAINED_LOG
    if not log.is_file():
        return
    kept = [json.dumps(e) for e in read_trained(log) if e["step"] <= step]
    tmp = log.with_name(f".{log.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, log)


def read_trained(log: Path) -> list[dict[str, Any]]:
    """trained.jsonl's entries. A crash mid-append leaves a torn last line: it is dropped (its
    collection's checkpoint, if any, was never finalized after it). A bad line elsewhere is
    corruption, named with its line number."""
    lines = [(n, line) for n, line in enumerate(log.read_text().splitlines(), 1) if line.strip()]
    out = []
    for k, (n, line) in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if k == len(lines) - 1:
                print(f"[rl-async] {log}:{n}: dropping a torn last line (a crash mid-write)",
                      flush=True)
                break
            raise ResumeError(f"{log}:{n}: not valid JSON ({exc.msg}); the trained log is "
                              f"corrupt") from None
    return out


def append_trained(run_dir: str | os.PathLike, step: int, version: int,
                   groups: list[tuple[str, int, int | None]],
                   info: dict[str, Any] | None = None) -> None:
    """One line per collection: the optimizer step it brought the trainer to, the policy
    version it was trained at, (group_id, attempt, oldest sampling version) per group, and
    `info`: `trainer_threads`, the torch threads each trainer worker trained it with (CPU:
    `rl-async replay` trains each collection with its own), and `skipped_updates`, its
    optimizer updates the non-finite guard skipped (their groups reached no weights)."""
    entry = {"step": step, "trained_at_version": version, "groups": [list(g) for g in groups],
             **(info or {})}
    with open(Path(run_dir) / TRAINED_LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")


def keep_schedule_horizon(saved: dict, cfg):
    """The resumed config, with train.lr_schedule_steps pinned to the horizon the run started
    with when run.max_steps changed and the horizon was not set on purpose: a cosine
    schedule then continues along its curve instead of jumping to another one (and
    `rl-async replay`, which reads the config from meta.json, retrains along the same)."""
    if cfg.train.lr_schedule_steps is not None:
        return cfg
    horizon = _get(saved, "train.lr_schedule_steps") or _get(saved, "run.max_steps")
    if horizon == cfg.run.max_steps:
        return cfg
    print(f"[rl-async] run.max_steps {_get(saved, 'run.max_steps')} -> {cfg.run.max_steps}: "
          f"the lr schedule keeps its horizon of {horizon} steps "
          f"(train.lr_schedule_steps; set it to change the horizon)", flush=True)
    return cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"lr_schedule_steps": horizon})})

