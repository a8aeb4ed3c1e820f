"""`ray job submit` end to end against a head started with `ray start --head` (see conftest):
a short run SUCCEEDS with a closed ledger; `ray job stop` on a long run ends it STOPPED after a
graceful drain that still prints the summary."""

from __future__ import annotations

import json
import re
import secrets
import time

import pytest

pytestmark = pytest.mark.ray

SHORT = ["run.max_steps=4", "wandb.mode=disabled", "rollout.rollout_batch_size=4",
         "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
         "train.micro_batch_size=16", "task.num_eval_prompts=8",
         "sglang.max_running_requests=8"]
LONG_STEPS = 100_000
# `ray job stop` sends SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (default 3 s),
# read by the job's supervisor actor, whose env includes the job's runtime_env env_vars.
STOP_WINDOW = {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "90"}}
JOB_TIMEOUT_S = 240
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
SUMMARY_MARK = "[rl-async] summary:"


def _sets(overrides: list[str]) -> list[str]:
    return [a for kv in overrides for a in ("--set", kv)]


def _submit(cluster, job_id: str, run_args: list[str], *extra: str) -> None:
    res = cluster.ray("job", "submit", "--address", cluster.dashboard_url,
                      "--working-dir", ".", "--no-wait", "--submission-id", job_id, *extra,
                      "--", "rl-async", "run", "cluster_configs/local.toml", *run_args)
    assert res.returncode == 0, f"ray job submit failed:\n{res.stdout}\n{res.stderr}"


def _wait_terminal(client, job_id: str) -> str:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        status = str(client.get_job_status(job_id).value)
        if status in TERMINAL:
            return status
        time.sleep(2)
    pytest.fail(f"job {job_id} not finished after {JOB_TIMEOUT_S}s; logs:\n"
                f"{client.get_job_logs(job_id)[-4000:]}")


def _summary_from_logs(logs: str) -> dict:
    assert SUMMARY_MARK in logs, f"no run summary in the job logs:\n{logs[-4000:]}"
    tail = logs[logs.rindex(SUMMARY_MARK) + len(SUMMARY_MARK):]
    summary, _ = json.JSONDecoder().raw_decode(tail[tail.index("{"):])
    return summary


def _assert_ledger_closed(summary: dict) -> None:
    ledger = summary["ledger"]
    assert ledger["unaccounted"] == 0, ledger
    others = sum(v for k, v in ledger.items() if k not in ("submitted_groups", "unaccounted"))
    assert ledger["submitted_groups"] == others > 0, ledger


def test_submitted_short_run_succeeds_with_closed_ledger(job_cluster, tmp_path):
    # Absolute: the job's cwd is the uploaded copy of the working dir, not this checkout.
    summary_path = tmp_path / "summary.json"
    job_id = f"rl-short-{secrets.token_hex(4)}"
    _submit(job_cluster, job_id,
            [*_sets([*SHORT, "run.name=job-short"]), "--summary-json", str(summary_path)])
    client = job_cluster.client()
    status = _wait_terminal(client, job_id)
    logs = client.get_job_logs(job_id)
    assert status == "SUCCEEDED", logs[-4000:]

    summary = json.loads(summary_path.read_text())
    assert summary == _summary_from_logs(logs)
    assert summary["steps"] == 4 and summary["policy_version"] == 4
    _assert_ledger_closed(summary)
    assert summary["failures"] == []

    # The documented CLI reads the same status and logs.
    res = job_cluster.ray("job", "status", "--address", job_cluster.dashboard_url, job_id)
    assert "succeeded" in (res.stdout + res.stderr).lower()


def _wait_for_training(client, job_id: str) -> None:
    """Until the driver's progress line shows at least one optimizer step."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        steps = [int(s) for s in re.findall(r"training\s+step (\d+)/", client.get_job_logs(job_id))]
        if steps and max(steps) >= 1:
            return
        status = str(client.get_job_status(job_id).value)
        assert status not in TERMINAL, f"job ended {status} before training:\n" \
            f"{client.get_job_logs(job_id)[-4000:]}"
        time.sleep(2)
    pytest.fail(f"no training progress in {JOB_TIMEOUT_S}s:\n{client.get_job_logs(job_id)[-4000:]}")


def test_job_stop_drains_gracefully_and_prints_summary(job_cluster):
    job_id = f"rl-long-{secrets.token_hex(4)}"
    _submit(job_cluster, job_id,
            _sets([*SHORT, "run.name=job-long", f"run.max_steps={LONG_STEPS}"]),
            "--runtime-env-json", json.dumps(STOP_WINDOW))
    client = job_cluster.client()
    _wait_for_training(client, job_id)

    res = job_cluster.ray("job", "stop", "--address", job_cluster.dashboard_url, job_id,
                          timeout=JOB_TIMEOUT_S)
    assert res.returncode == 0, f"ray job stop failed:\n{res.stdout}\n{res.stderr}"
    status = _wait_terminal(client, job_id)
    logs = client.get_job_logs(job_id)
    assert status == "STOPPED", logs[-4000:]

    # The stop window set through the runtime env reached the job (and so its supervisor).
    assert "allows 90 s for the graceful drain" in logs, logs[-4000:]
    # SIGTERM reached the driver, which asked the controller to stop, drained and summarised.
    assert "stopping gracefully" in logs, logs[-4000:]
    summary = _summary_from_logs(logs)
    assert 1 <= summary["steps"] < LONG_STEPS
    assert summary["eval"]["final_reward"] is not None
    _assert_ledger_closed(summary)
