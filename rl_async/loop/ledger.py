"""Prompt ownership from the source cursor until training accepts the group (SPEC §5, §6).

One owner per prompt (LESSONS: miles#2254): the ledger issues every group attempt and records
how it ends. A prompt's attempt moves through

    prompt_factory(cursor) --next_group()--> IN_FLIGHT --mark_buffered--> BUFFERED
    IN_FLIGHT --mark_aborted*-> aborted | --mark_filtered-> filtered | --mark_failed-> failed
    BUFFERED  --mark_delivered-> delivered (done) | --mark_discarded*-> discarded (stale)
              --mark_evicted*-> evicted | --mark_aborted*-> aborted | filtered | failed
    * retryable: handler "retry" with attempts left queues a fresh attempt of the ORIGINAL
      prompt, issued by next_group() before the cursor advances; with no attempts left that
      attempt ends as failed (with the reason) instead; handler "drop" does not retry.

Counting is per attempt: each issued attempt adds one `submitted_groups` where it is issued,
and ends exactly once in a terminal counter (delivered, discarded, evicted, aborted, filtered,
failed). The resident counts (in flight, buffered) are not counters: they are read off the
table of live attempts. `unaccounted = submitted - terminal - resident` is therefore an
independent conservation check, 0 unless a transition loses or double-counts an attempt. A
retry is counted only when it is issued. `prompt_factory` returns a NEW group of ungenerated
samples per call: the ledger keeps it as the prompt's original and copies every attempt from
it. Wire a CompletedBuffer to the ledger with
`CompletedBuffer(..., **ledger.buffer_callbacks())` so insertion, discard, eviction and delivery
are recorded synchronously at the moment they happen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rl_async.base.types import Group

HANDLERS = ("retry", "drop")
TERMINAL_KEYS = ("delivered_groups", "discarded_groups", "evicted_groups", "aborted_groups",
                 "filtered_groups", "failed_groups")
RESIDENT_KEYS = ("in_flight_groups", "buffered_groups")
COUNT_KEYS = ("submitted_groups", *TERMINAL_KEYS, *RESIDENT_KEYS)
IN_FLIGHT = "in_flight"
BUFFERED = "buffered"
RETRY = "retry"  # waiting in the retry queue; no live attempt
_STATE_COUNT = {IN_FLIGHT: "in_flight_groups", BUFFERED: "buffered_groups"}
STATE_FORMAT = 1


class LedgerError(RuntimeError):
    """An illegal ledger transition or state; the message names the group, attempt and state."""


@dataclass
class _Prompt:
    cursor: int
    original: Group  # as the factory made it, nothing generated: every retry starts here
    attempt: int  # the live attempt, or the next one while waiting for a retry
    state: str  # IN_FLIGHT, BUFFERED or RETRY
    # Attempts lost to restarts (resumes), not to the prompt: they spend no retry.
    restarts: int = 0


def _fresh(original: Group, attempt: int, cursor: int | None = None) -> Group:
    """A new attempt of the original prompt: no tokens, log-probs, versions or routes. The
    cursor rides along: with the attempt it seeds the group's sampling (rl_async.algo.seeding)."""
    return original.fresh_attempt().replace(
        attempt=attempt, cursor=original.cursor if cursor is None else cursor)


class PromptLedger:
    """Issues group attempts in cursor order (retries first) and accounts for every one."""

    def __init__(
        self,
        prompt_factory: Callable[[int], Group | None],
        max_retries: int,
        handler: str = "retry",
    ) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries = {max_retries!r}: must be an int >= 0")
        if handler not in HANDLERS:
            raise ValueError(
                f"handler = {handler!r}: must be one of {HANDLERS} (async.unused_samples_handler)")
        self._factory = prompt_factory
        self._max_retries = max_retries
        self._handler = handler
        self._prompts: dict[str, _Prompt] = {}  # every unfinished prompt, by group_id
        self._retry: deque[str] = deque()
        self._cursor = 0
        self._exhausted = False
        self._counts = dict.fromkeys(("submitted_groups", *TERMINAL_KEYS), 0)
        self._failures: list[dict[str, Any]] = []
        self._dropped_prompts = 0

    # --- queries --------------------------------------------------------------------------
    @property
    def cursor(self) -> int:
        """Index of the next new prompt the factory will be asked for."""
        return self._cursor

    @property
    def exhausted(self) -> bool:
        """True once the factory returned None and no retry is waiting."""
        return self._exhausted and not self._retry

    @property
    def pending_retries(self) -> int:
        return len(self._retry)

    @property
    def outstanding_prompts(self) -> int:
        """Prompts not finished: a live attempt (in flight, buffered) or waiting for a retry."""
        return len(self._prompts)

    @property
    def dropped_prompts(self) -> int:
        """Prompts given up without failure under handler "drop"."""
        return self._dropped_prompts

    def counts(self) -> dict[str, int]:
        """The SPEC §11 ledger: submitted and terminal counters, resident counts read off the
        live table, and `unaccounted` = submitted - terminal - resident (0 unless a bug)."""
        out = dict(self._counts)
        states = [p.state for p in self._prompts.values()]
        out["in_flight_groups"] = states.count(IN_FLIGHT)
        out["buffered_groups"] = states.count(BUFFERED)
        out["unaccounted"] = out["submitted_groups"] - sum(
            out[k] for k in (*TERMINAL_KEYS, *RESIDENT_KEYS))
        return out

    def failures(self) -> list[dict[str, Any]]:
        """Failed attempts: group_id, attempt, cursor and reason."""
        return [dict(f) for f in self._failures]

    # --- issuing --------------------------------------------------------------------------
    def next_group(self) -> Group | None:
        """The next attempt to generate (now in flight), retries first; None when exhausted."""
        if self._retry:
            prompt = self._prompts[self._retry.popleft()]
        else:
            prompt = self._new_prompt()
            if prompt is None:
                return None
        prompt.state = IN_FLIGHT
        self._counts["submitted_groups"] += 1
        return _fresh(prompt.original, prompt.attempt)

    def _new_prompt(self) -> _Prompt | None:
        if self._exhausted:
            return None
        group = self._factory(self._cursor)
        if group is None:
            self._exhausted = True
            return None
        if not isinstance(group, Group):
            raise TypeError(f"prompt_factory({self._cursor}) returned {type(group).__name__}, "
                            f"expected rl_async.base.types.Group or None (source exhausted)")
        if group.group_id in self._prompts:
            raise LedgerError(
                f"prompt_factory({self._cursor}) returned group_id {group.group_id!r}, which is "
                f"still outstanding from cursor {self._prompts[group.group_id].cursor}; group ids "
                f"must be unique per cursor (e.g. include the cursor or epoch in the id)"
            )
        # The factory's group is new and unshared: it becomes the original as it is (no
        # generated data to strip), with the ledger's cursor and attempt 0.
        group.attempt, group.cursor = 0, self._cursor
        prompt = _Prompt(self._cursor, group, 0, IN_FLIGHT)
        self._prompts[group.group_id] = prompt
        self._cursor += 1
        return prompt

    # --- transitions ----------------------------------------------------------------------
    def mark_buffered(self, group: Group) -> None:
        """Inserted into the completed buffer (ownership moves from the producer)."""
        self._move(self._live(group, "mark_buffered", (IN_FLIGHT,)), BUFFERED)

    def mark_delivered(self, group: Group) -> None:
        """Handed to training: the prompt is done."""
        self.mark_delivered_all([group])

    def mark_delivered_all(self, groups: Iterable[Group]) -> None:
        """Several deliveries, all or none: every group is checked before any is recorded."""
        groups = list(groups)
        prompts = [self._live(g, "mark_delivered", (BUFFERED,)) for g in groups]
        if len({g.group_id for g in groups}) != len(groups):
            raise LedgerError(f"mark_delivered: the same group appears twice in "
                              f"{[g.group_id for g in groups]}")
        for prompt, group in zip(prompts, groups):
            self._finish(prompt, group, "delivered_groups")

    def mark_discarded(self, group: Group, reason: str = "stale") -> None:
        """Discarded by the dequeue age filter; regenerated under the retry handler."""
        prompt = self._live(group, "mark_discarded", (BUFFERED,))
        self._end_retryable(prompt, group, "discarded_groups", reason)

    def mark_evicted(self, group: Group, reason: str = "evicted") -> None:
        """Evicted from the buffer; regenerated under the retry handler."""
        prompt = self._live(group, "mark_evicted", (BUFFERED,))
        self._end_retryable(prompt, group, "evicted_groups", reason)

    def mark_aborted(self, group: Group, reason: str) -> None:
        """Aborted by a publication or shutdown; regenerated under the retry handler."""
        prompt = self._live(group, "mark_aborted", (IN_FLIGHT, BUFFERED))
        self._end_retryable(prompt, group, "aborted_groups", reason)

    def mark_filtered(self, group: Group, reason: str = "filtered") -> None:
        """Rejected by a put-time filter: the prompt is done, not retried."""
        self._finish(self._live(group, "mark_filtered", (IN_FLIGHT, BUFFERED)), group,
                     "filtered_groups")

    def mark_failed(self, group: Group, error: BaseException | str) -> None:
        """Failed with an error (generation, reward): the prompt is done, see failures()."""
        prompt = self._live(group, "mark_failed", (IN_FLIGHT, BUFFERED))
        reason = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
        self._fail(prompt, group, str(reason))

    def record_buffer_discard(self, group: Group, reason: str) -> None:
        """`CompletedBuffer(on_discard=...)`: 'stale' is a discard, 'evicted_*' an eviction."""
        if reason == "stale":
            self.mark_discarded(group, reason)
        elif reason.startswith("evicted"):
            self.mark_evicted(group, reason)
        else:
            raise LedgerError(f"record_buffer_discard: unknown reason {reason!r} for group "
                              f"{group.group_id!r}; expected 'stale' or 'evicted_*'")

    def buffer_callbacks(self) -> dict[str, Callable[..., None]]:
        """Keyword arguments that make a CompletedBuffer report to this ledger."""
        return {"on_insert": self.mark_buffered, "on_discard": self.record_buffer_discard,
                "on_deliver": self.mark_delivered_all}

    # --- internals ------------------------------------------------------------------------
    def _live(self, group: Group, op: str, allowed: tuple[str, ...]) -> _Prompt:
        prompt = self._prompts.get(group.group_id)
        if prompt is None or prompt.state == RETRY or prompt.attempt != group.attempt:
            now = ("" if prompt is None else
                   f"; the ledger holds attempt {prompt.attempt} of it, state {prompt.state}")
            raise LedgerError(
                f"{op}: group {group.group_id!r} attempt {group.attempt} is not owned by the "
                f"ledger: it was never issued, has already ended, or is an older attempt{now}"
            )
        if prompt.state not in allowed:
            raise LedgerError(f"{op}: group {group.group_id!r} attempt {group.attempt} is "
                              f"{prompt.state}; {op} needs it {' or '.join(allowed)}")
        return prompt

    def _move(self, prompt: _Prompt, state: str) -> None:
        prompt.state = state

    def _finish(self, prompt: _Prompt, group: Group, count_key: str) -> None:
        self._move(prompt, RETRY)  # leaves the live counts; the prompt is then forgotten
        del self._prompts[group.group_id]
        self._counts[count_key] += 1

    def _fail(self, prompt: _Prompt, group: Group, reason: str) -> None:
        self._failures.append({"group_id": group.group_id, "attempt": prompt.attempt,
                               "cursor": prompt.cursor, "reason": reason})
        self._finish(prompt, group, "failed_groups")

    def _end_retryable(self, prompt: _Prompt, group: Group, count_key: str, reason: str) -> None:
        if self._handler == "drop":
            self._dropped_prompts += 1
            self._finish(prompt, group, count_key)
        elif prompt.attempt - prompt.restarts >= self._max_retries:
            self._fail(prompt, group, f"{count_key.removesuffix('_groups')} ({reason}) on "
                       f"attempt {prompt.attempt - prompt.restarts + 1} of "
                       f"{self._max_retries + 1} (max_retries={self._max_retries})")
        else:
            self._move(prompt, RETRY)
            self._counts[count_key] += 1
            prompt.attempt += 1
            self._retry.append(group.group_id)

    # --- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain data: cursor, counts, failures and every outstanding prompt (JSON-safe)."""
        waiting = [self._prompts[gid] for gid in self._retry]
        live = sorted((p for p in self._prompts.values() if p.state != RETRY),
                      key=lambda p: p.cursor)
        return {
            "format": STATE_FORMAT,
            "cursor": self._cursor,
            "exhausted": self._exhausted,
            "counts": {k: v for k, v in self.counts().items() if k != "unaccounted"},
            "outstanding": [{"group_id": p.original.group_id, "cursor": p.cursor,
                             "attempt": p.attempt, "restarts": p.restarts, "state": p.state}
                            for p in waiting + live],
            "failures": self.failures(),
            "dropped_prompts": self._dropped_prompts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a fresh ledger. Prompts in flight or buffered at the checkpoint were lost
        with the process: they count as aborted and are regenerated from their original prompts
        (not bounded by max_retries: a restart is not the prompt's fault)."""
        if self._counts["submitted_groups"] or self._prompts or self._cursor:
            raise LedgerError("load_state_dict: this ledger has already issued groups; restore "
                              "into a freshly constructed PromptLedger")
        if state.get("format") != STATE_FORMAT:
            raise LedgerError(f"load_state_dict: format {state.get('format')!r} is not "
                              f"{STATE_FORMAT}; the checkpoint was written by another version")
        counts = dict(state["counts"])
        if set(counts) != set(COUNT_KEYS):
            raise LedgerError(
                f"load_state_dict: counts keys {sorted(counts)} != {list(COUNT_KEYS)}")
        resident = {k: 0 for k in RESIDENT_KEYS}
        for entry in state["outstanding"]:
            prompt = self._restore_prompt(entry)
            if entry["state"] in _STATE_COUNT:
                resident[_STATE_COUNT[entry["state"]]] += 1
                counts["aborted_groups"] += 1
                prompt.attempt += 1  # a new attempt: new sampling seeds
                prompt.restarts += 1  # ... that spends none of the prompt's retries
            self._retry.append(entry["group_id"])
        if any(resident[k] != counts[k] for k in RESIDENT_KEYS):
            raise LedgerError(f"load_state_dict: the checkpoint counts {counts} do not match "
                              f"its outstanding list ({resident})")
        self._counts = {k: counts[k] for k in ("submitted_groups", *TERMINAL_KEYS)}
        self._cursor = int(state["cursor"])
        self._exhausted = bool(state["exhausted"])
        self._failures = [dict(f) for f in state["failures"]]
        self._dropped_prompts = int(state.get("dropped_prompts", 0))
        if self.counts()["unaccounted"] != 0:
            raise LedgerError(f"load_state_dict: inconsistent checkpoint counts {self.counts()}")

    def _restore_prompt(self, entry: dict[str, Any]) -> _Prompt:
        if entry["state"] not in (IN_FLIGHT, BUFFERED, RETRY):
            raise LedgerError(f"load_state_dict: outstanding prompt {entry['group_id']!r} has "
                              f"state {entry['state']!r}; expected in_flight, buffered or retry")
        if entry["group_id"] in self._prompts:
            raise LedgerError(f"load_state_dict: prompt {entry['group_id']!r} is listed twice "
                              f"in outstanding")
        group = self._factory(int(entry["cursor"]))
        if group is None or group.group_id != entry["group_id"]:
            got = None if group is None else group.group_id
            raise LedgerError(
                f"load_state_dict: prompt_factory({entry['cursor']}) gave group_id {got!r} but "
                f"the checkpoint has {entry['group_id']!r}; the prompt source must be "
                f"deterministic (same data, seed and order) to resume")
        cursor = int(entry["cursor"])
        prompt = _Prompt(cursor, _fresh(group, 0, cursor), int(entry["attempt"]), RETRY,
                         int(entry.get("restarts", 0)))
        self._prompts[group.group_id] = prompt
        return prompt
