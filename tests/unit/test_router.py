"""Router: least outstanding work, group affinity with an overload escape, accounting."""

from __future__ import annotations

import asyncio

import pytest

from rl_async.engine.base import GenerateOutput, SamplingParams
from rl_async.engine.router import Router, RouterPolicy


def test_least_outstanding_work_spreads_and_release_restores():
    router = Router(["e0", "e1", "e2"])
    picks = [router.pick(None, 100) for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]
    router.release(picks[0], 100)
    assert router.pick(None, 100) == picks[0]
    # A heavy request makes its engine the last choice.
    router = Router(["e0", "e1"])
    heavy = router.pick(None, 10_000)
    assert [router.pick(None, 10) for _ in range(5)] == [1 - heavy] * 5
    assert router.loads()[heavy]["outstanding_tokens"] == 10_000


def test_siblings_stay_together_when_not_overloaded():
    router = Router(["e0", "e1", "e2", "e3"])
    for g in range(4):
        picks = {router.pick(f"g{g}", 50) for _ in range(8)}
        assert len(picks) == 1
    # Four groups of eight went to four different engines.
    assert [load["outstanding_requests"] for load in router.loads()] == [8, 8, 8, 8]
    assert router.stats()["affinity_hits"] == 4 * 7


def test_affinity_yields_when_the_home_engine_is_overloaded_by_other_work():
    router = Router(["e0", "e1"], RouterPolicy(max_imbalance=0.5, request_weight=0))
    home = router.pick("g", 10)
    for _ in range(20):  # other work lands on the home engine (e.g. a long request)
        router._tokens[home] += 100
    assert router.pick("g", 10) == 1 - home
    assert router.stats()["affinity_moves"] == 1
    # The group now lives on the other engine.
    assert router.pick("g", 10) == 1 - home


def test_affinity_off_and_bad_arguments():
    router = Router(["e0", "e1"], RouterPolicy(affinity=False))
    assert {router.pick("g", 10) for _ in range(2)} == {0, 1}
    with pytest.raises(ValueError, match="release"):
        router.release(0, 10_000)
    with pytest.raises(ValueError, match="index"):
        router.release(5, 1)
    with pytest.raises(ValueError, match="engines"):
        Router([])
    with pytest.raises(ValueError, match="max_imbalance"):
        RouterPolicy(max_imbalance=-1)


class _FakeEngine:
    """Records concurrency; stands in for an Engine to test the router's own generate."""

    def __init__(self):
        self.calls = 0

    async def generate(self, input_ids, sampling_params, request_id=None):
        self.calls += 1
        await asyncio.sleep(0.001)
        if input_ids == [666]:
            raise RuntimeError("engine failure")
        return GenerateOutput(request_id or "r", [1], [0.0], [0], "length", len(input_ids))


def test_generate_releases_even_on_failure():
    engines = [_FakeEngine(), _FakeEngine()]
    router = Router(engines)

    async def run():
        outs = await asyncio.gather(*(router.generate([1, 2], SamplingParams(max_new_tokens=4),
                                                      group_id=f"g{i % 3}") for i in range(9)))
        with pytest.raises(RuntimeError, match="engine failure"):
            await router.generate([666], SamplingParams())
        return outs

    outs = asyncio.run(run())
    assert all(o.finish_reason == "length" for _, o in outs)
    assert sum(e.calls for e in engines) == 10
    assert all(load["outstanding_requests"] == 0 and load["outstanding_tokens"] == 0
               for load in router.loads())
