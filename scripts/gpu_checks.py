"""The GPU checks as one offline script: `python scripts/gpu_checks.py [--cpu] --out REPORT`.

Run through scripts/gpu_checks.sh, which sets up the import path (and megatron-core from a
local wheel folder). Needs torch and transformers; never imports Ray or SGLang and never
touches the network. Each check runs on the GPU (or, with --cpu, on the CPU, which is how CI
keeps this script from rotting) and the report is rewritten after every check, so a run cut
short by its time budget still says what passed:

    embedded_engine_vs_hf_generate    the embedded engine's greedy tokens and log-probs (several
                                      requests batched together) equal HF `generate` one by one
    torch_trainer_bf16_step           a torch-trainer step (bf16 autocast on GPU) gives the same
                                      loss and metrics as the fp32 CPU step, within bf16 error
    megatron_tp1_step_and_round_trip  HF -> megatron -> HF is exact; one TP1 step trains and its
                                      loss matches the torch trainer's (on GPU also with bf16
                                      params and the distributed optimizer)
    publication_buckets               bucket / flatten / unflatten of mixed-dtype tensors on the
                                      device is exact (the publication codec)
    publication_channel, publication_two_ranks, sglang_stop_rule, logprobs_chunked,
    memory_plan_torch_step, megatron_resume_and_memory, te_tp1_step, resume_fused_adam,
    memory_swiglu, sglang_health_rule: docs/gpu.md (what each shows and what it would have
                                      caught; a check that cannot run on this machine is
                                      `skipped` with the reason, and the run ends by listing
                                      what it skipped)

Report: {"device", "torch", "cuda", "gpu", "passed", "ray_imported", "skipped": {name:
reason}, "checks": {name: {"status": passed|failed|skipped|not_run, "seconds", "details" |
"error"}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from gpu_check_memory import (check_logprobs_chunked, check_megatron_resume_and_memory,
                              check_memory_plan_torch)
from gpu_check_publish import (check_publication_channel, check_publication_two_ranks,
                               check_sglang_stop_rule)
from gpu_check_stack import (check_memory_swiglu, check_resume_fused_adam,
                             check_sglang_health_rule, check_te_tp1_step)
from gpu_check_train import Skip, check_buckets, check_engine, check_megatron, check_torch_trainer

CHECKS = {"embedded_engine_vs_hf_generate": check_engine,
          "torch_trainer_bf16_step": check_torch_trainer,
          "megatron_tp1_step_and_round_trip": check_megatron,
          "publication_buckets": check_buckets,
          "publication_channel": check_publication_channel,
          "publication_two_ranks": check_publication_two_ranks,
          "sglang_stop_rule": check_sglang_stop_rule,
          "logprobs_chunked": check_logprobs_chunked,
          "memory_plan_torch_step": check_memory_plan_torch,
          "megatron_resume_and_memory": check_megatron_resume_and_memory,
          "te_tp1_step": check_te_tp1_step,
          "resume_fused_adam": check_resume_fused_adam,
          "memory_swiglu": check_memory_swiglu,
          "sglang_health_rule": check_sglang_health_rule}


# ---------------------------------------------------------------------------- the runner

def environment(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "gpu": None}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version
        info["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001 -- absent is a fact to report, not an error
        info["megatron_core"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run the checks on the CPU (CI)")
    ap.add_argument("--out", required=True, help="path of the JSON report")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no check once this many seconds have passed")
    ap.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run only these checks")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the CPU variant", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)) if args.cpu else torch.get_num_threads())
    names = args.only or list(CHECKS)
    report = {**environment(device), "passed": False, "ray_imported": False,
              "checks": {n: {"status": "not_run"} for n in names}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    for name in names:
        entry = report["checks"][name]
        if time.monotonic() - start > args.budget_s:
            entry["error"] = f"not started: the {args.budget_s:g} s budget was spent"
        else:
            t0 = time.monotonic()
            try:
                entry.update(status="passed", details=CHECKS[name](device))
            except Skip as exc:
                entry.update(status="skipped", error=str(exc))
            except Exception as exc:  # noqa: BLE001 -- recorded in the report, run goes on
                entry.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                             traceback=traceback.format_exc()[-3000:])
            entry["seconds"] = round(time.monotonic() - t0, 2)
            print(f"[gpu_checks] {name}: {entry['status']} ({entry['seconds']} s)"
                  + (f": {entry.get('error')}" if entry["status"] != "passed" else ""), flush=True)
        report["ray_imported"] = "ray" in sys.modules  # the script must work without Ray
        # A skipped check (no megatron-core here, a GPU-only measurement on --cpu) says so in
        # the report; it fails nothing. Not run (the budget) or failed does.
        report["passed"] = (all(c["status"] in ("passed", "skipped")
                                for c in report["checks"].values())
                            and any(c["status"] == "passed" for c in report["checks"].values())
                            and not report["ray_imported"])
        report["seconds"] = round(time.monotonic() - start, 2)
        report["skipped"] = {n: c["error"] for n, c in report["checks"].items()
                             if c["status"] == "skipped"}
        out.write_text(json.dumps(report, indent=2))
    for name, why in report["skipped"].items():
        print(f"[gpu_checks] skipped {name}: {why}", flush=True)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
