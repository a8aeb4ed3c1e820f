"""Multi-turn trajectories (SPEC §12): token-in/token-out against real chat templates, the
ends (done, max_turns, the token budget), environments that raise or hang, and trajectories
inside the producer (failed groups, counters, sticky routing)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from rl_async.algo.chat import ChatRenderer, digit_tokenizer
from rl_async.algo.environments import EnvironmentFailure, EnvironmentLoadError, load_environment
from rl_async.algo.tasks import EOS
from rl_async.base.types import Group, Sample
from rl_async.engine.base import GenerateOutput
from rl_async.engine.router import Router
from rl_async.loop.producer import Producer, ProducerLimits
from rl_async.loop.trajectory import TrajectoryLimits, TrajectoryRunner
from real_model import smollm2_tokenizer

DEMO_ENV = Path(__file__).resolve().parents[2] / "examples" / "envs" / "digit_sum.py"
ROW = {"id": "r1", "question": "What is 6 x 7?"}


class ToolEnv:
    """A calculator tool on turn 1, a user follow-up on turn 2, done after turn 3."""

    max_turns = 4

    def __init__(self):
        self.seen: list[list[dict]] = []

    async def reset(self, row):
        return [{"role": "system", "content": "You can call a calculator."},
                {"role": "user", "content": row["question"]}], {"turn": 0}

    async def step(self, messages, state):
        self.seen.append([dict(m) for m in messages])
        state["turn"] += 1
        if state["turn"] == 1:
            return [{"role": "tool", "content": "calculator: 6 * 7 = 42"}], False
        if state["turn"] == 2:
            return [{"role": "user", "content": "Now say it in words."}], False
        return [], True

    async def score(self, messages, state):
        return 1.0 if "forty" in messages[-1]["content"] else 0.25


class ScriptedEngine:
    """Replies per turn with fixed token ids, recording every request it was sent."""

    def __init__(self, replies: list[list[int]], finish: list[str], version: int = 7):
        self.replies, self.finish, self.version = replies, finish, version
        self.requests: list[tuple[list[int], int]] = []

    async def __call__(self, input_ids, max_new_tokens, turn):
        self.requests.append((list(input_ids), max_new_tokens))
        ids = self.replies[turn][:max_new_tokens]
        return GenerateOutput(f"t{turn}", ids, [-0.5] * len(ids), [self.version + turn] * len(ids),
                              self.finish[turn])


def spans(sample: Sample) -> list[tuple[int, list[int]]]:
    """Consecutive runs of response tokens with the same loss_mask value."""
    out: list[tuple[int, list[int]]] = []
    for tok, m in zip(sample.response_ids, sample.loss_mask):
        if out and out[-1][0] == m:
            out[-1][1].append(tok)
        else:
            out.append((m, [tok]))
    return out


def test_token_in_token_out_with_smollm2s_chat_template():
    tok = smollm2_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tok, (end,))
    # Turn 0 stops at <|im_end|>; turn 1 is cut by max_new_tokens (no stop token); turn 2
    # stops. The sampled ids are NOT what encoding their text gives: " forty" + "-two" split
    # oddly, so a re-tokenizing implementation would train other tokens than were sampled.
    words = tok.encode(" forty", add_special_tokens=False)
    replies = [tok.encode("call calculator(6*7)", add_special_tokens=False) + [end],
               tok.encode("The answer is 42 and", add_special_tokens=False),
               words + tok.encode("-", add_special_tokens=False)
               + [tok.convert_tokens_to_ids("t"), tok.convert_tokens_to_ids("wo"), end]]
    engine = ScriptedEngine(replies, ["stop", "length", "stop"])
    env = ToolEnv()
    runner = TrajectoryRunner(env, renderer, TrajectoryLimits(32, None, 5.0))
    sample = Sample(prompt_id="r1", metadata={"row": ROW, "where": "rows.jsonl:1"})
    result = asyncio.run(runner.run(sample, engine))

    assert (result.finish, result.turns, sample.turns, sample.reward) == ("done", 3, 3, 1.0)
    # Every request is the exact token sequence so far: the engine continues its own tokens.
    for turn, (request, _) in enumerate(engine.requests):
        assert request == sample.prompt_ids + sample.response_ids[:len(request)
                                                                  - len(sample.prompt_ids)]
    runs = spans(sample)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
    assert [ids for m, ids in runs if m == 1] == replies  # trained tokens = sampled tokens
    # Masked spans: the rest of the turn's closing, then the environment's messages as the
    # template renders them, then the next generation prompt.
    masked = [tok.decode(ids) for m, ids in runs if m == 0]
    assert masked[0] == "\n<|im_start|>tool\ncalculator: 6 * 7 = 42<|im_end|>\n<|im_start|>assistant\n"
    assert masked[1] == ("<|im_end|>\n<|im_start|>user\nNow say it in words.<|im_end|>\n"
                         "<|im_start|>assistant\n")
    # Independently: the whole trained sequence is the template's rendering of the final
    # conversation (as the environment saw it) up to the last sampled stop token.
    conversation = env.seen[-1]
    text = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(sample.prompt_ids + sample.response_ids) == text.rstrip("\n")
    # Per-token bookkeeping: sampled tokens keep log-probs and versions; masked have none.
    for tok_mask, lp, v in zip(sample.loss_mask, sample.behavior_logprobs, sample.token_versions):
        assert (lp, v) == ((-0.5, v) if tok_mask else (0.0, -1)) and (v >= 7 if tok_mask else True)
    assert sample.oldest_version() == 7  # the oldest sampled token; -1 (masked) is no version


def test_digit_chat_template_renders_turns_for_the_tiny_model():
    renderer = ChatRenderer(digit_tokenizer(), (EOS,))
    engine = ScriptedEngine([[4 + 9, EOS], [4 + 5, 4 + 1]], ["stop", "length"])
    env = load_environment(f"{DEMO_ENV}:make_env", {"digits": 2, "rule": "sum"})
    runner = TrajectoryRunner(env, renderer, TrajectoryLimits(2, 16, 5.0))
    sample = Sample(prompt_id="x", metadata={"row": {"digits": [9, 6]}})
    result = asyncio.run(runner.run(sample, engine))
    tok = renderer.tokenizer
    assert tok.decode(sample.prompt_ids) == "<s>9|"
    assert tok.decode(sample.response_ids) == "9</s>6|51"  # EOS sampled: only "6|" added
    assert sample.loss_mask == [1, 1, 0, 0, 1, 1]
    assert (result.finish, sample.reward) == ("done", 1.0)  # (9 + 6) % 10 = 5


class Endless:
    max_turns = 3

    async def reset(self, row):
        return [{"role": "user", "content": "1"}], None

    async def step(self, messages, state):
        return [{"role": "user", "content": "23"}], False

    async def score(self, messages, state):
        return 0.5


def test_truncation_by_turns_and_by_the_token_budget():
    renderer = ChatRenderer(digit_tokenizer(), (EOS,))
    sample = Sample(prompt_id="x", metadata={"row": {}})
    engine = ScriptedEngine([[4, EOS]] * 3, ["stop"] * 3)
    result = asyncio.run(TrajectoryRunner(Endless(), renderer, TrajectoryLimits(2, None, 5.0))
                         .run(sample, engine))
    assert (result.finish, result.truncated, sample.turns, sample.reward) == ("max_turns", True,
                                                                            3, 0.5)
    assert sample.loss_mask[-2:] == [1, 1]  # nothing answers the last environment turn
    # Budget 9: prompt 3 ("<s>1|"), turn 2 tokens, env 3 ("23|") = 8: one token of room left.
    sample = Sample(prompt_id="x", metadata={"row": {}})
    engine = ScriptedEngine([[4, EOS]] * 3, ["stop"] * 3)
    result = asyncio.run(TrajectoryRunner(Endless(), renderer, TrajectoryLimits(2, 9, 5.0))
                         .run(sample, engine))
    assert result.finish == "max_tokens" and result.truncated
    assert len(sample.prompt_ids) + sample.response_len == 9
    assert engine.requests[-1][1] == 1  # the last turn got only the budget's room


class Failing(Endless):
    def __init__(self, how: str):
        self.how = how

    async def step(self, messages, state):
        if self.how == "raise":
            raise KeyError("tool 'calc' is not registered")
        if self.how == "hang":
            await asyncio.sleep(60)
        return "not a tuple"


class Blocking(Endless):
    """A plain function that blocks until the test releases it: a timeout could only abandon
    it in a worker thread, running on, so it is refused and never called."""

    def __init__(self):
        self.release, self.returned = threading.Event(), False

    def step(self, messages, state):
        self.release.wait(30)
        self.returned = True
        return [], True


class Hanging(Endless):
    """An async step that hangs: the timeout must stop it, not leave it running."""

    def __init__(self):
        self.started = self.stopped = False

    async def step(self, messages, state):
        self.started = True
        try:
            await asyncio.sleep(60)
        finally:
            self.stopped = True
        return [], True


def test_a_timed_out_environment_call_is_stopped_and_sync_methods_are_refused(tmp_path):
    env = Hanging()
    renderer = ChatRenderer(digit_tokenizer(), (EOS,))
    sample = Sample(prompt_id="x", metadata={"row": {}, "where": "rows.jsonl:4"})

    async def main():
        with pytest.raises(EnvironmentFailure, match="took more than task.env_timeout_s = "
                                                     "0.2 s \\(the call was cancelled\\)"):
            await TrajectoryRunner(env, renderer, TrajectoryLimits(2, None, 0.2)).run(
                sample, ScriptedEngine([[4, EOS]] * 3, ["stop"] * 3))
        # The call is stopped by the time the failure arrives: nothing runs on.
        return env.started, env.stopped, len(asyncio.all_tasks())

    assert asyncio.run(main()) == (True, True, 1)
    f = tmp_path / "sync_env.py"
    f.write_text("class E:\n    max_turns = 1\n    async def reset(self, row): ...\n"
                 "    def step(self, m, s): ...\n    async def score(self, m, s): ...\n"
                 "def make(): return E()\n")
    with pytest.raises(EnvironmentLoadError, match="step is a plain function.*subprocess"):
        load_environment(f"{f}:make")


@pytest.mark.parametrize("env, cause", [
    (Failing("raise"), "environment step for row rows.jsonl:4 raised KeyError: \"tool 'calc'"),
    (Failing("hang"), "took more than task.env_timeout_s = 0.2 s"),
    (Blocking(), "step for row rows.jsonl:4 is a plain function; environment methods must "
                 "be `async def`"),
    (Failing("bad"), "returned 'not a tuple': expected (new_messages, done: bool)"),
])
def test_an_environment_that_raises_hangs_or_breaks_the_protocol_is_named(env, cause):
    renderer = ChatRenderer(digit_tokenizer(), (EOS,))
    sample = Sample(prompt_id="x", metadata={"row": {}, "where": "rows.jsonl:4"})

    async def main():
        try:
            await TrajectoryRunner(env, renderer, TrajectoryLimits(2, None, 0.2)).run(
                sample, ScriptedEngine([[4, EOS]] * 3, ["stop"] * 3))
        except EnvironmentFailure as exc:
            assert not getattr(env, "returned", False)  # a blocking step never ran
            return str(exc)
        finally:
            if isinstance(env, Blocking):
                env.release.set()

    assert cause in asyncio.run(main())


def test_loading_environments_names_the_problem(tmp_path):
    f = tmp_path / "env.py"
    f.write_text("class E:\n    async def reset(self, row): ...\n    async def step(self, m, s): ...\n"
                 "    async def score(self, m, s): ...\n\ndef good(turns=2):\n    e = E()\n"
                 "    e.max_turns = turns\n    return e\n\ndef no_turns():\n    return E()\n")
    assert load_environment(f"{f}:good", {"turns": 5}).max_turns == 5
    with pytest.raises(EnvironmentLoadError, match="max_turns = None"):
        load_environment(f"{f}:no_turns")
    with pytest.raises(EnvironmentLoadError, match="has no 'missing'"):
        load_environment(f"{f}:missing")
    with pytest.raises(EnvironmentLoadError, match="the factory raised TypeError"):
        load_environment(f"{f}:good", {"bogus": 1})
    with pytest.raises(EnvironmentLoadError, match="expected 'package.module:factory'"):
        load_environment("no_colon")


def test_trajectories_in_the_producer_fail_only_their_group_and_are_counted():
    renderer = ChatRenderer(digit_tokenizer(), (EOS,))

    class PerRow(Endless):
        async def step(self, messages, state):
            if state == "bad":
                raise RuntimeError("sandbox crashed")
            return [], True

        async def reset(self, row):
            return [{"role": "user", "content": "1"}], row["kind"]

    runner = TrajectoryRunner(PerRow(), renderer, TrajectoryLimits(2, None, 5.0))
    rows = iter([{"kind": "ok"}, {"kind": "bad"}, {"kind": "ok"}])
    inserted, failed, routed = [], [], []

    async def next_group():
        row = next(rows)
        return Group(f"g{len(inserted) + len(failed)}-{row['kind']}",
                     [Sample(prompt_id="p", metadata={"row": row}) for _ in range(2)])

    async def generate(sample, key, max_new_tokens=None):
        routed.append((key, max_new_tokens))
        return GenerateOutput("r", [4, EOS], [-1.0, -0.1], [3, 3], "stop")

    async def put(group):
        inserted.append(group)
        return 8

    async def on_failed(group, error):
        failed.append((group.group_id, error))

    async def main():
        producer = Producer(ProducerLimits("group", 2, 2, 4), next_group=next_group,
                            generate=generate, score=None, put=put, on_aborted=None,
                            on_failed=on_failed, group_errors=(EnvironmentFailure,),
                            trajectory=runner)
        producer.set_target(3)
        task = asyncio.create_task(producer.run())
        while len(inserted) + len(failed) < 3:
            await asyncio.sleep(0.01)
        producer.stop()
        await producer.wait_idle()
        task.cancel()
        return producer

    producer = asyncio.run(main())
    assert len(inserted) == 2 and len(failed) == 1
    assert "sandbox crashed" in failed[0][1] and failed[0][1].startswith("EnvironmentFailure")
    assert all(s.reward == 0.5 and s.turns == 1 for g in inserted for s in g.samples)
    # Finished trajectories only: the failed group's two are its failure, not trajectories.
    assert producer.stats.trajectories == 4 and producer.stats.turns == 4
    assert {k.rsplit("/", 1)[1] for k, _ in routed} == {"0", "1"}  # keyed per trajectory
    assert all(n == 2 for _, n in routed)


def test_sticky_routing_keeps_a_trajectory_on_its_engine_unless_it_is_lost():
    router = Router(["e0", "e1"])
    first = router.pick("g/0", 10, sticky=True)
    other = 1 - first
    router.set_healthy(other, False)
    router.pick("pile", 5000)  # heavy other work on the trajectory's engine
    router.set_healthy(other, True)
    router.release(first, 10, "g/0")
    assert router.pick("g/0", 10, sticky=True) == first  # stays, whatever the load
    assert router.pick("g/0", 10) == other  # plain group affinity would have moved it
    router.set_healthy(first, False)
    assert router.pick("g/0", 10, sticky=True) == other  # lost: the trajectory moves


def test_an_aborted_turn_costs_that_turn_not_the_group():
    """An engine lost mid-episode (or a drain past its timeout) aborts one turn: the producer
    sends the same tokens again (the router moves the trajectory to a live engine), the
    aborted output is never trained and the group is not regenerated. Past the retries the
    group is aborted with the cause."""
    renderer = ChatRenderer(digit_tokenizer(), (EOS,))

    class Two(Endless):
        max_turns = 2

        async def reset(self, row):
            return [{"role": "user", "content": "1"}], {"turn": 0}

        async def step(self, messages, state):
            state["turn"] += 1
            return [{"role": "user", "content": "2"}], state["turn"] == 2

    def world(aborts: int):
        inserted, aborted, requests = [], [], []

        async def next_group():
            return Group(f"g{len(inserted) + len(aborted)}",
                         [Sample(prompt_id="p", metadata={"row": {}})])

        async def generate(sample, key, max_new_tokens=None):
            requests.append(list(sample.prompt_ids))
            if 2 <= len(requests) <= 1 + aborts:
                return GenerateOutput("r", [6], [-2.0], [4], "abort")  # turn 1 lost
            return GenerateOutput("r", [4 + len(requests), EOS], [-1.0, -0.1], [3, 3], "stop")

        async def put(group):
            inserted.append(group)
            return 8

        async def on_aborted(group, reason="publication"):
            aborted.append(reason)

        async def main():
            producer = Producer(ProducerLimits("group", 1, 1, 4), next_group=next_group,
                                generate=generate, score=None, put=put,
                                on_aborted=on_aborted, on_failed=None, trajectory=TrajectoryRunner(
                                    Two(), renderer, TrajectoryLimits(2, None, 5.0)))
            producer.set_target(1)
            task = asyncio.create_task(producer.run())
            while not (inserted or aborted):
                await asyncio.sleep(0.01)
            producer.stop()
            await producer.wait_idle()
            task.cancel()
            return producer
        return asyncio.run(main()), inserted, aborted, requests

    producer, inserted, aborted, requests = world(aborts=1)
    assert len(inserted) == 1 and not aborted and producer.stats.retried_turns == 1
    assert requests[1] == requests[2]  # the same tokens sent again
    s = inserted[0].samples[0]
    assert 6 not in [t for t, m in zip(s.response_ids, s.loss_mask) if m]  # never trained
    producer, inserted, aborted, requests = world(aborts=4)
    assert aborted == ["an engine aborted a turn"]  # the ledger regenerates it, with why
