"""Recorded collections (`run.record_rollouts`): what each optimizer update trained, exactly.

    <run dir>/rollouts/step_000012.json.gz     {"step", "trained_at_version", "groups": [...]}

One file per collection, named by the optimizer step it brought the trainer to (as in
trained.jsonl), holding the groups in the order the trainer saw them (canonical: cursor,
attempt) with every field the loss reads: prompt and response ids, behaviour log-probs, token
versions, rewards, seeds. `rl-async replay RUN_DIR` feeds them back to a fresh trainer group of
the run's layout and compares the weights it ends with against the run's export. Written
atomically (temp file + rename): a crash leaves a complete file or none, and a resumed run
rewrites the steps it trains again.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from pathlib import Path
from typing import Any

from rl_async.state.checkpoints import TRAINED_LOG, read_trained, step_name
from rl_async.base.types import Group, RoutedExperts, Sample

ROLLOUTS = "rollouts"


class ReplayError(RuntimeError):
    """A run directory that cannot be replayed (missing log, recording or checkpoint)."""


def rollout_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS / f"{step_name(step)}.json.gz"


def write_collection(run_dir: str | os.PathLike, step: int, version: int,
                     groups: list[Group]) -> Path:
    path = rollout_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    record = {"step": step, "trained_at_version": version,
              "groups": [_group_record(g) for g in groups]}
    # No name, mtime 0: the same collection gives the same bytes (recordings can be diffed)
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                               mtime=0) as f:
        f.write(json.dumps(record, default=repr).encode())
    os.replace(tmp, path)
    return path


# Views added to each recorded sample (SPEC §12), dropped again on replay.
_VIEWS = ("tokens", "versions")


def _group_record(group: Group) -> dict[str, Any]:
    """A group's fields, and per sample what was trained in one place: `tokens` (prompt and
    response ids), `loss_mask` and `versions` (one per response token; masked tokens are the
    environment's, version -1) and `turns`."""
    record = dataclasses.asdict(group)
    for s, sample in zip(record["samples"], group.samples):
        s["tokens"] = s["prompt_ids"] + s["response_ids"]
        s["loss_mask"] = s["loss_mask"] or [1] * len(s["response_ids"])
        s["versions"] = s["token_versions"]
        routed = s.pop("routed_experts")
        if routed is not None:
            # Per response token [layers][k]: the experts of the forward that sampled it
            # (the position before it); the prompt's other positions beside them.
            rows = sample.routed_experts.rows()
            split = len(s["prompt_ids"]) - 1
            s["routed_experts"], s["prompt_routed_experts"] = rows[split:], rows[:split]
    return record


def group_from_dict(d: dict[str, Any]) -> Group:
    samples = []
    for s in d["samples"]:
        fields = {k: v for k, v in s.items() if k not in _VIEWS and k != "prompt_routed_experts"}
        if fields.get("routed_experts") is not None:
            fields["routed_experts"] = RoutedExperts.from_rows(
                s.get("prompt_routed_experts", []) + s["routed_experts"])
        if all(m == 1 for m in fields.get("loss_mask", ())):
            fields["loss_mask"] = []  # all sampled: the single-turn form (same training)
        samples.append(Sample(**fields))
    return Group(**{**d, "samples": samples})


def require_recorded(run_dir: str | os.PathLike, step: int) -> Path:
    """The recording of `step`, or a ReplayError naming the file and the key that makes it."""
    path = rollout_path(run_dir, step)
    if not path.is_file():
        raise ReplayError(f"{path}: no recorded collection for step {step}; the run must be "
                          f"made with run.record_rollouts = true to be replayed")
    return path


def read_collection(run_dir: str | os.PathLike, step: int) -> tuple[int, list[Group]]:
    """(trained_at_version, groups in training order) of the collection that made `step`."""
    path = require_recorded(run_dir, step)
    with gzip.open(path, "rb") as f:
        record = json.loads(f.read())
    return int(record["trained_at_version"]), [group_from_dict(g) for g in record["groups"]]


def version_assignment(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """trained.jsonl: per collection, the step it made, the version it was trained at and
    (group_id, attempt, oldest sampling version) per group, in training order."""
    log = Path(run_dir) / TRAINED_LOG
    if not log.is_file():
        raise ReplayError(f"{log}: missing; is {run_dir} a run directory "
                          f"(<run.output_dir>/<run.name>/run-<UTC time>)?")
    return read_trained(log)


def compare_exports(a: str | os.PathLike, b: str | os.PathLike) -> dict[str, Any]:
    """Bitwise comparison of two Hugging Face exports' tensors: identical, the largest
    |difference| and the names that differ (or exist on one side only)."""
    import torch
    from safetensors.torch import load_file

    def tensors(directory) -> dict:
        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise ReplayError(f"{directory}: no *.safetensors files (not an HF export)")
        return {k: v for f in files for k, v in load_file(str(f)).items()}

    left, right = tensors(a), tensors(b)
    differ = sorted(set(left) ^ set(right))
    max_diff = 0.0
    for name in sorted(set(left) & set(right)):
        x, y = left[name], right[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            differ.append(name)
        elif not x.contiguous().view(torch.uint8).equal(y.contiguous().view(torch.uint8)):
            differ.append(name)  # compared as bytes: bit-identical, not merely close
            max_diff = max(max_diff, (x.double() - y.double()).abs().max().item())
    return {"identical": not differ, "max_abs_diff": max_diff, "tensors": len(left),
            "differing": differ[:10]}
