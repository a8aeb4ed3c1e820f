"""scripts/gpu_checks.sh --cpu: the GPU checks' CPU variant runs end to end in CI, so the
script a lent GPU machine runs cannot rot. Real subprocess, real checks, tiny models."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_checks.sh"
CHECKS = {"embedded_engine_vs_hf_generate", "torch_trainer_bf16_step",
          "megatron_tp1_step_and_round_trip", "publication_buckets", "publication_channel",
          "logprobs_chunked", "memory_plan_torch_step", "megatron_resume_and_memory",
          "publication_two_ranks", "sglang_stop_rule", "te_tp1_step", "resume_fused_adam",
          "memory_swiglu", "sglang_health_rule"}
# skipped on --cpu (and SGLang is not installed in CI)
GPU_ONLY = {"memory_plan_torch_step", "megatron_resume_and_memory", "sglang_stop_rule",
            "te_tp1_step", "resume_fused_adam", "memory_swiglu", "sglang_health_rule"}


# Imported at interpreter start-up (PYTHONPATH): Ray, SGLang and the HTTP/config stack are
# "not installed" for the script, as on a bare GPU machine.
BLOCKER = """
import sys
BLOCKED = {"ray", "sglang", "aiohttp", "pydantic"}
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _Blocker())
"""


def run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path),
           "PYTHONPATH": str(site)}
    env.pop("RL_ASYNC_WHEELS", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cpu_run_passes_every_check_without_ray_or_sglang(tmp_path):
    out = tmp_path / "report" / "checks.json"
    proc = run("--cpu", "--out", str(out), "--budget-s", "300", tmp_path=tmp_path)
    report = json.loads(out.read_text())
    statuses = {name: c["status"] for name, c in report["checks"].items()}
    assert set(statuses) == CHECKS
    has_megatron = importlib.util.find_spec("megatron.core") is not None
    for name in GPU_ONLY:
        assert statuses.pop(name) == "skipped", name
    if has_megatron:
        assert statuses == dict.fromkeys(CHECKS - GPU_ONLY, "passed"), (statuses, proc.stdout[-3000:])
        assert report["passed"] is True and proc.returncode == 0
    else:  # without megatron-core (and no --wheels) that one check is skipped, not failed
        assert statuses.pop("megatron_tp1_step_and_round_trip") == "skipped"
        assert set(statuses.values()) == {"passed"}, statuses
    assert report["device"] == "cpu" and report["ray_imported"] is False
    assert report["checks"]["embedded_engine_vs_hf_generate"]["details"]["requests"] == 4
    # the run says what it skipped and why, in the report and at the end of its output
    assert GPU_ONLY <= set(report["skipped"])
    assert "needs a GPU" in report["skipped"]["te_tp1_step"]
    assert all(f"skipped {name}: " in proc.stdout for name in report["skipped"])


def test_the_stack_checks_name_what_a_gpu_machine_lacks(tmp_path, monkeypatch):
    """On a GPU machine without Transformer Engine or SGLang, the stack checks skip naming
    the missing package (pretended here: the checks' own gate, on this CPU machine)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check_stack as stack
    from gpu_check_train import Skip

    monkeypatch.setattr(stack, "_installed", lambda module: module == "megatron.core")
    for check, missing in ((stack.check_te_tp1_step, "transformer_engine"),
                           (stack.check_resume_fused_adam, "transformer_engine"),
                           (stack.check_sglang_health_rule, "sglang")):
        try:
            check("cuda")
        except Skip as exc:
            assert f"needs {missing}, not installed here" in str(exc)
        else:
            raise AssertionError(f"{check.__name__} ran without {missing}")


def test_bad_arguments_and_missing_cuda_are_refused(tmp_path):
    proc = run("--gpu-please", tmp_path=tmp_path)
    assert proc.returncode == 2 and "unknown argument '--gpu-please'" in proc.stderr
    # Without a GPU, the GPU variant refuses to pretend (no report of passed checks).
    import torch

    if not torch.cuda.is_available():
        proc = run("--out", str(tmp_path / "r.json"), tmp_path=tmp_path)
        assert proc.returncode == 2 and "run with --cpu" in proc.stderr
