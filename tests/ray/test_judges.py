"""Judges on Ray Serve: autoscaling under load and back, grades through the reward actor,
retries then a clear error for a failing judge. Replicas sleep; they never compute."""

import time
from collections import Counter

import pytest

from rl_async.plan.load import load_config
from rl_async.algo.judging import judge_deployment
from rl_async.base.types import Sample

pytestmark = [pytest.mark.ray,
              # The test's 1 s look-back is shorter than Serve's deprecated metrics interval.
              pytest.mark.filterwarnings("ignore:`look_back_period_s`:FutureWarning")]

# The reward actor holds the handle, and Serve autoscales on the handle's metrics; push them
# every 0.5 s instead of every 10 s so the test sees scaling decisions quickly.
ACTOR_ENV = {"env_vars": {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                          "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}}
FAST = dict(upscale_delay_s=0.5, downscale_delay_s=1.0, look_back_period_s=1.0, num_cpus=0.1)
DIGIT0 = 4  # token id of digit 0 in the successor task's vocabulary


@pytest.fixture(scope="module")
def serve_cluster(ray_cluster):
    from ray import serve

    yield ray_cluster
    serve.shutdown()  # leaves the shared cluster as it found it


def cfg_for(name, *overrides):
    return load_config("cluster_configs/local.toml",
                       ["wandb.mode=disabled", f"run.name={name}", "judge.enabled=true",
                        *overrides])


def successor_sample(i):
    """Prompt ...d with answer d+1; even i answer right, odd i answer wrong."""
    answer = DIGIT0 + (i + 1) % 10
    response = answer if i % 2 == 0 else DIGIT0 + (i + 5) % 10
    return Sample(prompt_id=f"p{i}", response_ids=[response, 2], metadata={"answer_ids": [answer]})


def wait_until(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout_s}s (bounded poll): {what}")


def test_judge_deployment_errors_name_the_key():
    cfg = cfg_for("t-judge-cfg")
    with pytest.raises(ValueError, match="judge.look_back_period_s"):
        judge_deployment(cfg.judge, "r", look_back_period_s=0)
    with pytest.raises(ValueError, match="unknown"):
        judge_deployment(cfg.judge, "r", upscale_delay=1)
    dep = judge_deployment(cfg_for("t", "judge.min_replicas=1", "judge.max_replicas=3").judge,
                           "run", **FAST)
    assert dep.app_name == "run-judge"
    assert dep.autoscaling["min_replicas"] == 1 and dep.autoscaling["max_replicas"] == 3
    assert dep.autoscaling["upscale_delay_s"] == 0.5


def test_rule_judge_scales_up_under_load_grades_right_and_scales_down(serve_cluster):
    import ray

    from actors.judges import delete_judge, deploy_judge, judge_replicas
    from actors.rewards import RewardActor

    cfg = cfg_for("t-judge-scale", "judge.min_replicas=1", "judge.max_replicas=3",
                  "judge.target_ongoing_requests=1", "judge.max_ongoing_requests=2",
                  "judge.timeout_s=60", "reward.concurrency=64")
    dep = judge_deployment(cfg.judge, cfg.run.name, kwargs={"latency_s": 0.5}, **FAST)
    deploy_judge(dep)
    try:
        assert judge_replicas(dep.app_name) == 1
        reward = RewardActor.options(runtime_env=ACTOR_ENV).remote(cfg)
        # Keep 16 requests in flight (target is 1 per replica) until Serve adds replicas,
        # so the load lasts however long the scale-up takes on a busy machine.
        submitted, pending, peak = [], [], 1
        deadline = time.monotonic() + 60
        while peak < 2 and time.monotonic() < deadline:
            if pending:
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            while len(pending) < 16:
                i = len(submitted)
                submitted.append((i, reward.score.remote(successor_sample(i))))
                pending.append(submitted[-1][1])
            peak = max(peak, judge_replicas(dep.app_name))
        assert peak >= 2, "judge replicas never scaled above min_replicas under load"
        grades = ray.get([ref for _, ref in submitted])
        assert grades == [1.0 if i % 2 == 0 else 0.0 for i, _ in submitted]
        # Load stopped: back down to min_replicas, never above max_replicas meanwhile.
        counts = []
        wait_until(lambda: counts.append(judge_replicas(dep.app_name)) or counts[-1] == 1,
                   60, "judge replicas back to min_replicas = 1 after the load stopped")
        assert max(counts + [peak]) <= 3
        metrics = ray.get(reward.metrics.remote())
        assert metrics["reward/failures"] == 0 and metrics["reward/calls"] == len(submitted)
        ray.kill(reward)
    finally:
        delete_judge(dep.app_name)
    assert judge_replicas(dep.app_name) == 0


def test_failing_judge_is_retried_then_reported(serve_cluster):
    import ray

    from actors.judges import delete_judge, deploy_judge
    from actors.rewards import RewardActor
    from rl_async.algo.rewards import RewardError

    class FlakyJudge:  # local class: pickled by value, so the replica needs no test import
        """Raises on the first `failures` calls for each prompt, then grades 1.0."""

        def __init__(self, failures):
            self.failures, self.calls = failures, Counter()

        def grade(self, sample):  # sync on purpose: the replica runs it in a thread
            self.calls[sample.prompt_id] += 1
            if self.calls[sample.prompt_id] <= self.failures:
                raise ValueError(f"flaky judge: call {self.calls[sample.prompt_id]} "
                                 f"on {sample.prompt_id}")
            return 1.0

    base = cfg_for("t-judge-flaky", "judge.min_replicas=1", "judge.max_replicas=1",
                   "judge.timeout_s=20")
    dep = judge_deployment(base.judge, base.run.name, kwargs={"failures": 2}, **FAST)
    deploy_judge(dep, judge_class=FlakyJudge)
    try:
        patient = RewardActor.remote(cfg_for("t-judge-flaky", "judge.max_retries=2"))
        assert ray.get(patient.score.remote(Sample(prompt_id="ok"))) == 1.0
        assert ray.get(patient.metrics.remote())["reward/retries"] == 2
        strict = RewardActor.remote(cfg_for("t-judge-flaky", "judge.max_retries=1"))
        with pytest.raises(RewardError) as err:
            ray.get(strict.score.remote(Sample(prompt_id="bad")))
        msg = str(err.value)
        assert "judge" in msg and "'bad'" in msg and "2 attempt(s)" in msg
        assert "ValueError: flaky judge: call 2 on bad" in msg
        assert ray.get(strict.metrics.remote())["reward/failures"] == 1
        ray.kill(patient)
        ray.kill(strict)
    finally:
        delete_judge(dep.app_name)


def test_short_run_grades_through_the_judge_and_deletes_it(serve_cluster, tmp_path):
    import json
    import threading

    from actors.judges import judge_replicas
    from launch.run import run_training
    from rl_async.plan.checks import validate

    cfg = load_config("cluster_configs/local.toml", [
        "run.max_steps=2", "wandb.mode=disabled", "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
        "train.micro_batch_size=16", "task.num_eval_prompts=8", "run.name=t-judge-run",
        "judge.enabled=true", "judge.max_replicas=1"])
    seen, done = [], threading.Event()

    def watch():  # the fleet deploys the judge inside the controller actor
        while not done.is_set():
            seen.append(judge_replicas("t-judge-run-judge"))
            done.wait(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out = tmp_path / "summary.json"
    try:
        code = run_training(cfg, validate(cfg), str(out))
    finally:
        done.set()
        watcher.join()
    summary = json.loads(out.read_text())
    assert code == 0, summary
    assert summary["ledger"]["unaccounted"] == 0 and summary["ledger"]["failed_groups"] == 0
    assert summary["ledger"]["delivered_groups"] == 2 * 4
    assert max(seen) == 1, "the judge deployment never ran during the run"
    assert judge_replicas("t-judge-run-judge") == 0  # deleted at fleet shutdown
