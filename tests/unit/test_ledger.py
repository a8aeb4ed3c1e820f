"""PromptLedger: issuing, transitions, retries from the original prompt, checkpoints (SPEC §6)."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from rl_async.loop.buffer import CompletedBuffer
from rl_async.loop.ledger import COUNT_KEYS, LedgerError, PromptLedger
from rl_async.base.types import Group, Sample


def factory(cursor: int, n: int = 2) -> Group | None:
    return Group(f"p{cursor}", [Sample(f"p{cursor}", prompt_ids=[cursor, 7],
                                       metadata={"answer": cursor}) for _ in range(n)])


def generate(group: Group, version: int = 0) -> Group:
    """What a producer does: fill responses, versions, log-probs and rewards in place."""
    for s in group.samples:
        s.response_ids, s.token_versions = [1, 2, 3], [version] * 3
        s.behavior_logprobs, s.reward, s.finish_reason = [-0.1] * 3, 1.0, "stop"
        s.metadata["route"] = "engine-3"
    return group


def counts(ledger: PromptLedger, **expected: int) -> None:
    got = ledger.counts()
    assert got["unaccounted"] == 0
    assert {k: got[k] for k in expected} == expected


# --- construction and issuing ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs, key", [({"max_retries": -1}, "max_retries"),
                                         ({"max_retries": 1, "handler": "keep"}, "handler")])
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        PromptLedger(factory, **kwargs)


def test_counts_has_exactly_the_spec_keys():
    assert list(PromptLedger(factory, 1).counts()) == list(COUNT_KEYS) + ["unaccounted"]


def test_issues_in_cursor_order_as_in_flight():
    ledger = PromptLedger(factory, 1)
    assert [ledger.next_group().group_id for _ in range(3)] == ["p0", "p1", "p2"]
    assert ledger.cursor == 3
    counts(ledger, submitted_groups=3, in_flight_groups=3)


def test_factory_none_means_exhausted():
    ledger = PromptLedger(lambda c: factory(c) if c < 1 else None, 1)
    g = ledger.next_group()
    assert ledger.next_group() is None and ledger.cursor == 1
    ledger.mark_buffered(g)
    ledger.mark_discarded(g)
    assert not ledger.exhausted  # a retry is still waiting
    assert ledger.next_group().attempt == 1 and ledger.exhausted


def test_duplicate_ids_and_bad_factory_output_refused():
    with pytest.raises(LedgerError, match="unique per cursor"):
        dup = PromptLedger(lambda c: factory(0), 1)
        dup.next_group()
        dup.next_group()
    with pytest.raises(TypeError, match="prompt_factory"):
        PromptLedger(lambda c: "prompt", 1).next_group()


# --- the happy path and terminal transitions ------------------------------------------------
def test_buffered_then_delivered():
    ledger = PromptLedger(factory, 1)
    g = generate(ledger.next_group())
    ledger.mark_buffered(g)
    counts(ledger, in_flight_groups=0, buffered_groups=1)
    ledger.mark_delivered(g)
    counts(ledger, submitted_groups=1, delivered_groups=1, buffered_groups=0)
    assert ledger.outstanding_prompts == 0


def test_filtered_and_failed_are_terminal():
    ledger = PromptLedger(factory, 3)
    a, b = ledger.next_group(), ledger.next_group()
    ledger.mark_filtered(a, "all rewards equal")
    ledger.mark_buffered(b)
    ledger.mark_failed(b, RuntimeError("judge timed out"))
    counts(ledger, filtered_groups=1, failed_groups=1, in_flight_groups=0, buffered_groups=0)
    assert ledger.next_group().group_id == "p2"  # nothing was queued for retry
    assert ledger.failures() == [{"group_id": "p1", "attempt": 0, "cursor": 1,
                                  "reason": "RuntimeError: judge timed out"}]


# --- retries --------------------------------------------------------------------------------
@pytest.mark.parametrize("end", ["discarded", "evicted", "aborted_buffered", "aborted_in_flight"])
def test_retry_is_a_fresh_attempt_of_the_original_prompt_issued_first(end):
    ledger = PromptLedger(factory, 2)
    g = generate(ledger.next_group(), version=4)
    g.samples[0].prompt_ids.append(99)  # a producer scribbling on its copy changes nothing
    if end != "aborted_in_flight":
        ledger.mark_buffered(g)
    {"discarded": lambda: ledger.mark_discarded(g), "evicted": lambda: ledger.mark_evicted(g),
     "aborted_buffered": lambda: ledger.mark_aborted(g, "publication"),
     "aborted_in_flight": lambda: ledger.mark_aborted(g, "shutdown")}[end]()
    retry = ledger.next_group()
    assert (retry.group_id, retry.attempt, ledger.cursor) == ("p0", 1, 1)
    for s in retry.samples:
        assert (s.response_ids, s.token_versions, s.behavior_logprobs) == ([], [], [])
        assert s.reward is None and s.finish_reason == ""
        assert s.prompt_ids == [0, 7] and s.metadata == {"answer": 0}
    key = {"discarded": "discarded_groups", "evicted": "evicted_groups"}.get(end, "aborted_groups")
    counts(ledger, submitted_groups=2, in_flight_groups=1, **{key: 1})


def test_retries_exhausted_end_as_failed_with_reason():
    ledger = PromptLedger(factory, max_retries=1)
    for expected_attempt in (0, 1):
        g = ledger.next_group()
        assert (g.group_id, g.attempt) == ("p0", expected_attempt)
        ledger.mark_buffered(g)
        ledger.mark_discarded(g, "stale")
    counts(ledger, submitted_groups=2, discarded_groups=1, failed_groups=1)
    (failure,) = ledger.failures()
    assert failure["group_id"] == "p0" and failure["attempt"] == 1
    assert "stale" in failure["reason"] and "max_retries=1" in failure["reason"]
    assert ledger.next_group().group_id == "p1" and ledger.pending_retries == 0


def test_drop_handler_does_not_retry():
    ledger = PromptLedger(factory, max_retries=5, handler="drop")
    g = ledger.next_group()
    ledger.mark_buffered(g)
    ledger.mark_evicted(g, "evicted_overflow")
    assert ledger.next_group().group_id == "p1"
    counts(ledger, evicted_groups=1, failed_groups=0)
    assert ledger.dropped_prompts == 1 and ledger.failures() == []


# --- illegal transitions --------------------------------------------------------------------
def test_illegal_transitions_raise_clear_errors():
    ledger = PromptLedger(factory, 2)
    g = ledger.next_group()
    with pytest.raises(LedgerError, match="is in_flight; mark_delivered needs it buffered"):
        ledger.mark_delivered(g)
    with pytest.raises(LedgerError, match="'nope' attempt 0 is not owned"):
        ledger.mark_buffered(Group("nope", []))
    ledger.mark_buffered(g)
    with pytest.raises(LedgerError, match="mark_buffered needs it in_flight"):
        ledger.mark_buffered(g)
    ledger.mark_discarded(g)
    with pytest.raises(LedgerError, match="older attempt"):
        ledger.mark_discarded(g)  # the old attempt ended; its retry waits
    retry = ledger.next_group()
    ledger.mark_buffered(retry)
    ledger.mark_delivered(retry)
    with pytest.raises(LedgerError, match="already ended"):
        ledger.mark_delivered(retry)
    counts(ledger, submitted_groups=2, delivered_groups=1, discarded_groups=1)


def test_delivering_several_is_all_or_none():
    ledger = PromptLedger(factory, 2)
    a, b = ledger.next_group(), ledger.next_group()
    ledger.mark_buffered(a)
    with pytest.raises(LedgerError, match="'p1'"):
        ledger.mark_delivered_all([a, b])
    counts(ledger, delivered_groups=0, buffered_groups=1, in_flight_groups=1)
    with pytest.raises(LedgerError, match="twice"):
        ledger.mark_delivered_all([a, a])


def test_buffer_discard_reasons_map_to_counts():
    ledger = PromptLedger(factory, 2)
    gs = [ledger.next_group() for _ in range(3)]
    for g in gs:
        ledger.mark_buffered(g)
    ledger.record_buffer_discard(gs[0], "stale")
    ledger.record_buffer_discard(gs[1], "evicted_overflow")
    with pytest.raises(LedgerError, match="unknown reason"):
        ledger.record_buffer_discard(gs[2], "lost")
    counts(ledger, discarded_groups=1, evicted_groups=1, buffered_groups=1)


def test_ledger_error_pickles():
    err = pickle.loads(pickle.dumps(LedgerError("group 'p1' attempt 0 is in_flight")))
    assert isinstance(err, LedgerError) and "p1" in str(err)


# --- wired to the buffer --------------------------------------------------------------------
def test_buffer_callbacks_record_every_decision_synchronously():
    async def main():
        ledger = PromptLedger(factory, 2)
        buf = CompletedBuffer(2, max_lag=1, overflow="evict", **ledger.buffer_callbacks())
        buf.set_version(3)
        for v in (0, 3, 3):  # the v0 group is beyond the lag and evicted on overflow
            await buf.put(generate(ledger.next_group(), v))
        counts(ledger, evicted_groups=1, buffered_groups=2)
        out = await buf.get(2, 3)
        counts(ledger, delivered_groups=2, buffered_groups=0)
        return out
    assert [g.group_id for g in asyncio.run(main())] == ["p1", "p2"]


# --- checkpointing --------------------------------------------------------------------------
def test_state_dict_restores_cursor_counts_and_outstanding_prompts():
    ledger = PromptLedger(factory, 3)
    gs = [generate(ledger.next_group(), 1) for _ in range(4)]
    ledger.mark_buffered(gs[0])
    ledger.mark_delivered(gs[0])
    ledger.mark_buffered(gs[1])  # buffered at the checkpoint
    ledger.mark_buffered(gs[2])
    ledger.mark_discarded(gs[2])  # waiting for its retry (attempt 1)
    ledger.mark_failed(gs[3], "reward crashed")
    state = json.loads(json.dumps(ledger.state_dict()))  # plain, JSON-safe data

    restored = PromptLedger(factory, 3)
    restored.load_state_dict(state)
    assert restored.cursor == 4 and restored.failures() == ledger.failures()
    counts(restored, submitted_groups=4, delivered_groups=1, discarded_groups=1,
           failed_groups=1, aborted_groups=1, in_flight_groups=0, buffered_groups=0)
    again = [restored.next_group() for _ in range(3)]
    assert [(g.group_id, g.attempt) for g in again] == [("p2", 1), ("p1", 1), ("p4", 0)]
    assert all(s.response_ids == [] and s.prompt_ids == [1, 7] for s in again[1].samples)
    counts(restored, submitted_groups=7, in_flight_groups=3)


def test_restore_refuses_a_nondeterministic_source_and_a_used_ledger():
    ledger = PromptLedger(factory, 1)
    ledger.next_group()
    state = ledger.state_dict()
    with pytest.raises(LedgerError, match="deterministic"):
        PromptLedger(lambda c: factory(c + 1), 1).load_state_dict(state)
    with pytest.raises(LedgerError, match="freshly constructed"):
        ledger.load_state_dict(state)
    with pytest.raises(LedgerError, match="format"):
        PromptLedger(factory, 1).load_state_dict({**state, "format": 99})
    bad = {**state, "counts": {**state["counts"], "submitted_groups": 5}}
    with pytest.raises(LedgerError, match="inconsistent"):
        PromptLedger(factory, 1).load_state_dict(bad)


def test_unaccounted_is_an_independent_check_that_a_broken_counter_fails():
    ledger = PromptLedger(factory, max_retries=2)
    groups = [ledger.next_group() for _ in range(4)]
    ledger.mark_buffered(groups[0])
    ledger.mark_delivered(groups[0])
    ledger.mark_aborted(groups[1], "publication")
    assert ledger.counts()["unaccounted"] == 0
    assert ledger.counts()["in_flight_groups"] == 2  # read off the table: groups 2 and 3
    # A transition that forgets its terminal counter: the check sees the lost attempt.
    original = ledger._finish

    def forgetful_finish(prompt, group, count_key):
        original(prompt, group, count_key)
        ledger._counts[count_key] -= 1

    ledger._finish = forgetful_finish
    ledger.mark_filtered(groups[2], "zero variance")
    assert ledger.counts()["unaccounted"] == 1
    # And an issue that is not counted where it happens.
    ledger._finish = original
    ledger._counts["submitted_groups"] -= 2
    assert ledger.counts()["unaccounted"] == -1


def test_a_resume_spends_none_of_a_prompts_retries():
    """Every resume regenerates the prompts that were in flight as a new attempt (new seeds),
    but the restart is not the prompt's fault: with max_retries = 1 a prompt resumed twice
    still gets its one retry (it used to fail on its first stale discard)."""
    state = None
    for _ in range(2):  # in flight at two checkpoints in a row
        ledger = PromptLedger(factory, max_retries=1)
        if state is not None:
            ledger.load_state_dict(state)
        group = ledger.next_group()
        assert group.group_id == "p0"
        state = json.loads(json.dumps(ledger.state_dict()))
    ledger = PromptLedger(factory, max_retries=1)
    ledger.load_state_dict(state)
    group = ledger.next_group()
    assert group.attempt == 2  # two restarts: two new attempts, new seeds
    ledger.mark_buffered(group)
    ledger.mark_discarded(group, "stale")  # its first real retry
    retry = ledger.next_group()
    assert retry.group_id == "p0" and retry.attempt == 3 and not ledger.failures()
    ledger.mark_buffered(retry)
    ledger.mark_discarded(retry, "stale")  # the second: past max_retries
    [failure] = ledger.failures()
    assert "attempt 2 of 2 (max_retries=1)" in failure["reason"]
    counts(ledger, failed_groups=1)
