"""Property tests: nothing is lost between the ledger and the completed buffer (SPEC §6).

Random interleavings of issue, put, get, cancel, version bumps, aborts, filters, failures,
reserve changes and retries run through a real PromptLedger wired to a real CompletedBuffer.
After every step `unaccounted` is 0 and the live counts match where the groups actually are;
at the end (shutdown) every issued group attempt has ended exactly once.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_async.loop.buffer import BufferClosedError, CompletedBuffer
from rl_async.loop.ledger import PromptLedger
from rl_async.base.types import Group, Sample

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("issue"), st.integers(0, 4), st.booleans()),
        st.tuples(st.just("put"), st.integers(0, 7)),
        st.tuples(st.just("get"), st.integers(1, 4)),
        st.tuples(st.just("cancel"), st.integers(0, 7)),
        st.tuples(st.just("bump"), st.booleans()),
        st.tuples(st.sampled_from(["abort", "filter", "fail"]), st.integers(0, 7)),
        st.tuples(st.just("reserve"), st.integers(0, 2)),
        st.tuples(st.just("settle"), st.integers(1, 3)),
    ),
    max_size=40,
)
CONFIG = st.fixed_dictionaries({
    "capacity": st.integers(1, 4),
    "max_lag": st.one_of(st.none(), st.integers(0, 3)),
    "order": st.sampled_from(["fifo", "lifo"]),
    "max_retries": st.integers(0, 2),
    "handler": st.sampled_from(["retry", "retry", "drop"]),
})


def prompt_factory(cursor: int) -> Group:
    return Group(f"p{cursor}", [Sample(f"p{cursor}", prompt_ids=[cursor]) for _ in range(2)])


class Sim:
    """One run: the ledger, the buffer, and where every live attempt is held."""

    def __init__(self, cfg: dict, overflow: str) -> None:
        self.ledger = PromptLedger(prompt_factory, cfg["max_retries"], cfg["handler"])
        cb = self.ledger.buffer_callbacks()
        self.ended: Counter = Counter()  # (group_id, attempt) -> times it ended
        self.issued: set[tuple[str, int]] = set()
        self.max_lag = cfg["max_lag"]
        self.overflow = overflow

        def on_discard(g: Group, reason: str) -> None:
            cb["on_discard"](g, reason)
            self.ended[(g.group_id, g.attempt)] += 1

        def on_deliver(gs: list[Group]) -> None:
            cb["on_deliver"](gs)
            for g in gs:
                self.ended[(g.group_id, g.attempt)] += 1

        self.buf = CompletedBuffer(cfg["capacity"], cfg["max_lag"], cfg["order"], overflow,
                                   on_discard, on_insert=cb["on_insert"], on_deliver=on_deliver)
        self.version = 0
        self.producer: list[Group] = []  # generated, not being put
        self.puts: dict[asyncio.Task, Group] = {}
        self.gets: dict[asyncio.Task, int] = {}  # task -> version it asked with

    def issue(self, lag: int, unknown: bool) -> None:
        g = self.ledger.next_group()
        assert all(not s.response_ids and not s.token_versions for s in g.samples)
        key = (g.group_id, g.attempt)
        assert key not in self.issued
        self.issued.add(key)
        for i, s in enumerate(g.samples):
            s.response_ids = [1] * (i + 1)
            s.token_versions = [] if unknown else [max(0, self.version - lag - i)] * (i + 1)
        self.producer.append(g)

    def end_held(self, op: str, idx: int) -> None:
        if not self.producer:
            return
        g = self.producer.pop(idx % len(self.producer))
        {"abort": lambda: self.ledger.mark_aborted(g, "publication"),
         "filter": lambda: self.ledger.mark_filtered(g, "zero advantage"),
         "fail": lambda: self.ledger.mark_failed(g, RuntimeError("reward crashed"))}[op]()
        self.ended[(g.group_id, g.attempt)] += 1

    def harvest(self) -> None:
        for task in [t for t in self.puts if t.done()]:
            g = self.puts.pop(task)
            if task.cancelled():
                self.producer.append(g)  # a cancelled put inserted nothing: still ours
            else:
                assert task.exception() is None
        for task in [t for t in self.gets if t.done()]:
            version = self.gets.pop(task)
            if not task.cancelled() and task.exception() is not None:
                # A get left waiting across a version bump reached a newer group: it raised
                # and put back what it had taken (the accounting checks below still hold).
                assert isinstance(task.exception(), ValueError), task.exception()
                assert "newer than the current version" in str(task.exception())
            elif not task.cancelled():
                for g in task.result():
                    age = g.age(version)
                    assert g.age_at_delivery == age
                    assert age is None or self.max_lag is None or age <= self.max_lag

    def check(self) -> None:
        c = self.ledger.counts()
        assert c["unaccounted"] == 0, c
        assert c["in_flight_groups"] == len(self.producer) + len(self.puts), c
        assert c["buffered_groups"] == len(self.buf) + self.buf.held, c
        assert all(n == 1 for n in self.ended.values()), self.ended
        if self.overflow == "evict":
            assert not self.puts  # an evicting put never waits

    async def step(self, op: tuple) -> None:
        kind = op[0]
        if kind == "issue":
            self.issue(op[1], op[2])
        elif kind == "put" and self.producer:
            g = self.producer.pop(op[1] % len(self.producer))
            self.puts[asyncio.create_task(self.buf.put(g))] = g
        elif kind == "get":
            self.gets[asyncio.create_task(self.buf.get(op[1], self.version))] = self.version
        elif kind == "cancel":
            pending = [t for t in list(self.puts) + list(self.gets) if not t.done()]
            if pending:
                pending[op[1] % len(pending)].cancel()
        elif kind == "bump":
            self.version += 1
            if op[1]:
                self.buf.set_version(self.version)
        elif kind in ("abort", "filter", "fail"):
            self.end_held(kind, op[1])
        elif kind == "reserve":
            self.buf.release_reserve()
            self.buf.reserve(op[1])
        for _ in range(op[1] if kind == "settle" else 1):
            await asyncio.sleep(0)
        self.harvest()
        self.check()

    async def shutdown(self) -> None:
        self.buf.close("shutdown")
        for task in list(self.puts) + list(self.gets):
            task.cancel()
        await asyncio.gather(*self.puts, *self.gets, return_exceptions=True)
        for task, g in list(self.puts.items()):
            if task.cancelled() or isinstance(task.exception(), BufferClosedError):
                self.producer.append(g)
        self.puts.clear()
        self.harvest()
        for g in self.buf.drain_all() + self.producer:
            self.ledger.mark_aborted(g, "shutdown")
            self.ended[(g.group_id, g.attempt)] += 1
        self.producer.clear()
        self.check()
        c = self.ledger.counts()
        assert c["in_flight_groups"] == c["buffered_groups"] == 0
        assert set(self.ended) == self.issued and c["submitted_groups"] == len(self.issued)
        terminal = sum(v for k, v in c.items() if k not in
                       ("submitted_groups", "in_flight_groups", "buffered_groups", "unaccounted"))
        assert terminal == len(self.issued)


async def simulate(cfg: dict, overflow: str, ops: list[tuple]) -> Sim:
    sim = Sim(cfg, overflow)
    for op in ops:
        await sim.step(op)
    await sim.shutdown()
    return sim


PROPERTY = settings(max_examples=700, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(cfg=CONFIG, ops=OPS)
def test_block_mode_accounts_for_every_attempt(cfg, ops):
    asyncio.run(simulate(cfg, "block", ops))


@PROPERTY
@given(cfg=CONFIG, ops=OPS)
def test_evict_mode_accounts_for_every_attempt(cfg, ops):
    asyncio.run(simulate(cfg, "evict", ops))


@settings(max_examples=1000, deadline=None)
@given(max_retries=st.integers(0, 3), handler=st.sampled_from(["retry", "drop"]),
       choices=st.lists(st.integers(0, 6), max_size=60))
def test_ledger_alone_bounds_retries_and_balances(max_retries, handler, choices):
    ledger = PromptLedger(prompt_factory, max_retries, handler)
    live: list[tuple[Group, bool]] = []  # (group, buffered?)
    attempts: Counter = Counter()
    for choice in choices:
        if choice == 0 or not live:
            g = ledger.next_group()
            attempts[g.group_id] += 1
            assert g.attempt == attempts[g.group_id] - 1 <= max_retries
            live.append((g, False))
            continue
        g, buffered = live.pop(choice % len(live))
        if not buffered:
            if choice % 2:
                ledger.mark_buffered(g)
                live.append((g, True))
            else:
                ledger.mark_aborted(g, "publication")
        else:
            (ledger.mark_delivered, ledger.mark_discarded, ledger.mark_evicted,
             lambda x: ledger.mark_failed(x, "boom"))[choice % 4](g)
        assert ledger.counts()["unaccounted"] == 0
    c = ledger.counts()
    assert c["in_flight_groups"] + c["buffered_groups"] == len(live)
    if handler == "drop":
        assert max(attempts.values(), default=1) == 1
    state = ledger.state_dict()
    restored = PromptLedger(prompt_factory, max_retries, handler)
    restored.load_state_dict(state)
    rc = restored.counts()
    assert rc["unaccounted"] == 0 and rc["in_flight_groups"] == rc["buffered_groups"] == 0
    assert restored.pending_retries == ledger.pending_retries + len(live)
