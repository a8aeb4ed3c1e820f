"""The publication state machine (rl_async.loop.publish) and the controller's use of it: the
deadline (`publication.timeout_s`), the stage named when it is missed, and the rule that GPU
trainers never overlap publication with training.

The fleets here are fakes of the PublicationOps/Fleet interface: these are unit tests of the
state machine and the controller loop, not of the Ray fleet (tests/ray covers that)."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.plan.checks import validate
from rl_async.plan.load import resolve
from rl_async.loop.controller import Controller, RunFailed, publication_overlaps_training
from rl_async.loop.publish import PublicationError, PublicationTimeout, Publisher, PubState
from rl_async.base.types import Group, Sample

MODEL = {"hf_config": {"model_type": "llama"}}


class FakeOps:
    """PublicationOps that record calls; `hang_at` makes one stage (or one bucket) never
    return, like a broadcast whose peer died."""

    def __init__(self, buckets: int = 3, hang_at: str | None = None, hang_bucket: int = -1):
        self.buckets, self.hang_at, self.hang_bucket = buckets, hang_at, hang_bucket
        self.calls: list[str] = []
        self.versions: list[int] = []

    async def _step(self, name: str) -> None:
        self.calls.append(name)
        if name == self.hang_at:
            await asyncio.Event().wait()  # never set

    async def snapshot(self) -> None:
        await self._step("snapshot")

    async def stop_submissions(self) -> None:
        await self._step("stop_submissions")

    async def drain(self, timeout_s: float) -> bool:
        await self._step("drain")
        return True

    async def pause_engines(self, mode: str) -> None:
        await self._step(f"pause_engines:{mode}")

    async def send(self, version: int, progress) -> int:
        for i in range(self.buckets):
            progress(i, self.buckets)
            await self._step(f"bucket{i}")
            if i == self.hang_bucket:
                await asyncio.Event().wait()
        self.versions.append(version)
        return 10 * self.buckets

    async def continue_engines(self) -> None:
        await self._step("continue_engines")

    async def resume_submissions(self) -> None:
        await self._step("resume_submissions")


def run(coro):
    return asyncio.run(coro)


def run_controller(controller, fleet) -> None:
    """Run the controller to its end; the fake producer task is cancelled however it ends."""
    async def main():
        try:
            await controller.run()
        finally:
            fleet.producer.cancel()
    run(main())


def test_publication_runs_every_stage_in_order():
    ops = FakeOps(buckets=2)
    pub = Publisher("off", drain_timeout_s=1.0, timeout_s=30.0)
    result = run(pub.publish(4, ops))
    assert ops.calls == ["snapshot", "stop_submissions", "drain", "bucket0", "bucket1",
                         "continue_engines", "resume_submissions"]
    assert ops.versions == [4] and result.bytes == 20 and result.version == 4
    assert pub.state is PubState.IDLE
    assert pub.history == [PubState.SNAPSHOTTING, PubState.PAUSING, PubState.TRANSFERRING,
                           PubState.RESUMING, PubState.IDLE]


def test_hung_bucket_fails_with_version_stage_and_bucket_named():
    ops = FakeOps(buckets=5, hang_bucket=2)
    pub = Publisher("off", drain_timeout_s=1.0, timeout_s=0.2)
    with pytest.raises(PublicationTimeout) as info:
        run(pub.publish(7, ops))
    assert str(info.value).startswith(
        "publication of version 7 timed out after 0.2 s in stage transferring (bucket 3/5)")
    assert "publication.timeout_s" in str(info.value)
    # The engines were never resumed under half-updated weights, and no more publications.
    assert "continue_engines" not in ops.calls
    assert pub.state is PubState.FAILED
    with pytest.raises(PublicationError, match="one transfer at a time"):
        run(pub.publish(8, FakeOps()))


@pytest.mark.parametrize("stage, named", [("snapshot", "stage snapshotting"),
                                          ("drain", "stage pausing"),
                                          ("continue_engines", "stage resuming")])
def test_every_stage_is_under_the_deadline(stage, named):
    pub = Publisher("off", drain_timeout_s=1.0, timeout_s=0.2)
    with pytest.raises(PublicationTimeout, match=f"version 3 timed out after 0.2 s in {named};"):
        run(pub.publish(3, FakeOps(hang_at=stage)))


def test_startup_transfer_is_under_the_deadline_and_skips_pausing():
    ops = FakeOps(buckets=2)
    assert run(Publisher("off", 1.0, 30.0).transfer(0, ops)) == 20
    assert ops.calls == ["snapshot", "bucket0", "bucket1"] and ops.versions == [0]
    with pytest.raises(PublicationTimeout, match="version 0 .* stage transferring .bucket 2/2."):
        run(Publisher("off", 1.0, 0.2).transfer(0, FakeOps(buckets=2, hang_bucket=1)))


def test_an_ops_own_timeout_is_not_reported_as_the_deadline():
    class OwnTimeout(FakeOps):
        async def drain(self, timeout_s: float) -> bool:
            raise TimeoutError("producer drain RPC timed out")

    pub = Publisher("off", 1.0, 30.0)
    with pytest.raises(TimeoutError, match="producer drain RPC") as info:
        run(pub.publish(1, OwnTimeout()))
    assert not isinstance(info.value, PublicationTimeout)
    assert pub.state is PubState.FAILED


# ---- the controller ------------------------------------------------------------------------

def config(**sections):
    data = {"model": MODEL, "async": {"fully_async": True, "max_weight_staleness": 2},
            "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2},
            "run": {"max_steps": 3}, "publication": {"drain_timeout_s": 0.05, "timeout_s": 0.2}}
    for k, v in sections.items():
        data.setdefault(k.rstrip("_"), {}).update(v)
    cfg = resolve(data)
    return cfg, validate(cfg).plan


class FakeFleet(FakeOps):
    """The controller's Fleet: groups are always ready; training records its calls."""

    def __init__(self, drain_until_trains: int = 0, **kw):
        super().__init__(**kw)
        self.producer = None
        # With overlap, a drain that only ends once the next collection trains shows that
        # training does not wait for the publication (up to this many train calls).
        self.drain_until_trains = drain_until_trains
        self.trains = 0
        self.trained = asyncio.Event()

    async def drain(self, timeout_s: float) -> bool:
        await self._step("drain")
        if self.trains < self.drain_until_trains:
            before = self.trains
            while self.trains == before:
                self.trained.clear()
                await self.trained.wait()
        return True

    async def producer_task(self):
        self.producer = asyncio.ensure_future(asyncio.Event().wait())
        return self.producer

    async def get_groups(self, n, version):
        return [Group(group_id=f"g{i}", samples=[Sample(prompt_id=f"p{i}", response_ids=[1],
                                                        token_versions=[version],
                                                        behavior_logprobs=[-1.0], reward=1.0)])
                for i in range(n)]

    async def train(self, groups, version):
        self.calls.append(f"train:{version}")
        self.trains += 1
        self.trained.set()
        return {"train/loss": 0.0}

    async def evaluate(self):
        return {"reward": 0.0}

    async def record_trained(self, step, version, groups, info=None): ...
    async def progress_marker(self): return self.trains
    async def diagnosis(self): return {}
    async def faults(self): return {}
    async def rollout(self): return {}

    async def metrics(self):
        return {}

    async def ledger(self):
        return {}

    async def producer_set_target(self, groups): ...
    async def producer_pause_admission(self): ...
    async def producer_resume_admission(self): ...
    async def producer_wait_idle(self, timeout_s): return True
    async def producer_stop(self): ...
    async def producer_set_budget(self, groups): ...
    async def buffer_set_version(self, version, engine_version=None): ...
    async def buffer_reserve(self, n_groups): ...
    async def producer_groups_owned(self): return 0
    async def checkpoint(self, step, version, progress=None): ...


def test_controller_fails_the_run_when_a_transfer_hangs():
    cfg, plan = config()
    fleet = FakeFleet(buckets=4, hang_bucket=1)
    controller = Controller(cfg, plan, fleet, lambda metrics, step: None, watchdog_s=30.0)
    with pytest.raises((RunFailed, PublicationTimeout),
                       match="publication of version 1 timed out after 0.2 s in stage "
                             "transferring .bucket 2/4."):
        run_controller(controller, fleet)
    assert controller.progress.phase == "failed"


def test_gpu_trainers_never_overlap_publication_with_training():
    cfg, plan = config()
    assert publication_overlaps_training(cfg, plan)
    gpu, gpu_plan = config(cluster={"trainer_gpus": 1, "inference_gpus": 1})
    assert not publication_overlaps_training(gpu, gpu_plan)
    sync, sync_plan = config(async_={"fully_async": False, "max_weight_staleness": 0})
    assert not publication_overlaps_training(sync, sync_plan)
    # Lag 1 publishes between steps: overlapping would make the next collection's early
    # tokens two versions old at their dequeue, past the lag.
    lag1, lag1_plan = config(async_={"max_weight_staleness": 1})
    assert not publication_overlaps_training(lag1, lag1_plan)

    async def trace(cfg, plan, drain_until_trains=0):
        fleet = FakeFleet(buckets=1, drain_until_trains=drain_until_trains)
        controller = Controller(cfg, plan, fleet, lambda metrics, step: None)
        try:
            await controller.run()
        finally:
            fleet.producer.cancel()
        return fleet.calls

    def order(calls):
        return [c for c in calls if c.startswith("train:") or c in ("snapshot", "resume_submissions")]

    # GPU: each publication has resumed the engines before the next collection trains.
    assert order(run(trace(gpu, gpu_plan))) == [
        "train:0", "snapshot", "resume_submissions", "train:1", "snapshot",
        "resume_submissions", "train:2", "snapshot", "resume_submissions"]
    # CPU with lag: the next collection trains while the publication is still under way.
    assert order(run(trace(cfg, plan, drain_until_trains=3))) == [
        "train:0", "snapshot", "train:1", "resume_submissions", "snapshot", "train:2",
        "resume_submissions", "snapshot", "resume_submissions"]


def test_mid_run_evaluation_drains_only_when_asked():
    """eval.drain = false (default): an async run evaluates while generation goes on, after
    the publication in flight has landed; true: admission pauses around it."""
    class Recording(FakeFleet):
        async def producer_pause_admission(self):
            self.calls.append("pause_admission")

        async def evaluate(self):
            self.calls.append("evaluate")
            return {"reward": 0.0}

    def trace(drain=False):
        cfg, plan = config(eval={"every_steps": 1, "drain": drain})
        fleet = Recording(buckets=1)
        controller = Controller(cfg, plan, fleet, lambda metrics, step: None)
        run_controller(controller, fleet)
        calls = [c for c in fleet.calls if c in ("evaluate", "pause_admission", "resume_submissions")]
        return calls, len(controller.progress.eval_curve)

    calls, evals = trace()
    # initial, after steps 1 and 2 (each after its publication resumed), final after the
    # shutdown drain (which pauses admission, as it always does)
    assert evals == 4
    assert calls[:5] == ["evaluate", "resume_submissions", "evaluate", "resume_submissions",
                         "evaluate"]
    assert calls.count("pause_admission") == 1
    drained, _ = trace(drain=True)
    assert drained.count("pause_admission") == 3


def test_publication_cadence_skips_versions_but_evaluations_and_the_end_get_current_weights():
    """publication.every_updates = 2: publish once the trainer is two updates past the
    engines; a mid-run evaluation (step 3) and the end of the run publish what was skipped,
    so evaluations always see the trained weights."""
    def published(**sections):
        cfg, plan = config(**sections)
        fleet = FakeFleet(buckets=1)
        metrics = []
        controller = Controller(cfg, plan, fleet, lambda m, step: metrics.append(m))
        run_controller(controller, fleet)
        skipped = [m["publish/skipped"] for m in metrics if "publish/skipped" in m]
        # every publication reaches the calibration, those before evaluations too
        assert controller.calibration.pubs == len(fleet.versions)
        return fleet.versions, skipped

    lag4 = {"async_": {"max_weight_staleness": 4}, "run": {"max_steps": 6}}
    assert published(**lag4) == ([1, 2, 3, 4, 5, 6], [0.0] * 6)
    versions, skipped = published(**lag4, publication={"every_updates": 2},
                                  eval={"every_steps": 3})
    # 2 (due), 3 (before the step-3 evaluation), 5 (due: 2 past 3), 6 (before the final eval)
    assert versions == [2, 3, 5, 6]
    assert skipped == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("sections, error", [
    ({"async_": {"fully_async": False, "max_weight_staleness": 0}},
     "needs an async run with a lag of at least 2"),
    ({"async_": {"max_weight_staleness": 2}}, "trail the trainer by 3 updates"),
    ({"async_": {"max_weight_staleness": 4}, "publication": {"every_updates": 4}},
     "trail the trainer by 5 updates"),
    ({"async_": {"max_weight_staleness": 4}}, None),
    ({"async_": {"max_weight_staleness": 4}, "publication": {"every_updates": 3}}, None),
])
def test_validate_bounds_the_publication_cadence_by_the_lag(sections, error):
    sections.setdefault("publication", {}).setdefault("every_updates", 2)
    sections["publication"].update(timeout_s=300.0)
    cfg, _ = config(**sections)
    errors = [e for e in validate(cfg).errors if "publication.every_updates" in e]
    if error is None:
        assert not errors
    else:
        assert len(errors) == 1 and error in errors[0], errors


def test_validate_requires_the_deadline_to_cover_the_drain_and_the_channel_deadlines():
    cfg, _ = config(publication={"drain_timeout_s": 100.0, "timeout_s": 150.0})
    errors = validate(cfg).errors
    assert any("publication.timeout_s = 150 must exceed 2 x publication.drain_timeout_s + 2 x "
               "publication.channel_timeout_s = 200 + 120 = 320" in e for e in errors), errors
    # the drain fits, but not a replacement's join plus one hung engine's bucket
    tight, _ = config(publication={"drain_timeout_s": 30.0, "timeout_s": 150.0,
                                   "channel_timeout_s": 50.0})
    assert any("= 60 + 100 = 160" in e for e in validate(tight).errors)
    ok, _ = config(publication={"drain_timeout_s": 30.0, "timeout_s": 300.0})
    assert not [e for e in validate(ok).errors if "publication.timeout_s" in e]


# ---- the publication group's own timeout (real gloo, two processes) ---------------------

def _hung_peer(rank: int, port: int, timeout_s: float, results, release) -> None:
    """Rank 0 broadcasts; rank 1 joins the group but never takes part (a hung engine)."""
    import torch
    import torch.distributed as dist

    from rl_async.state.collective import init_custom_process_group

    group = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, rank, "pub",
                                      timeout_s)
    if rank == 1:
        release.get()  # stay alive (and silent) until rank 0 has reported
        return
    try:
        dist.broadcast(torch.zeros(4), group=group, group_src=0)
        outcome = "returned"
    except RuntimeError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    results.put(outcome)
    release.put("done")


def test_the_group_timeout_turns_a_hung_broadcast_into_an_error():
    """publication.timeout_s is also the publication group's collective timeout (actors/
    fleet.py passes it): a broadcast whose peer never joins fails instead of waiting out the
    default (30 minutes under NCCL's watchdog)."""
    from two_ranks import run_pair

    outcome = run_pair(_hung_peer, 1.0)
    assert outcome != "returned" and "timed out" in outcome.lower(), outcome
