"""The OpenAI-compatible gateway (SPEC §12) driven by a real `openai` client over loopback:
token-in/token-out against SmolLM2's real template, the completions endpoint, the token and
trajectory checks, history rewrites refused, aborted turns, budgets."""

from __future__ import annotations

import asyncio

import openai
import pytest

from rl_async.algo.chat import ChatRenderer
from rl_async.algo.environments import EnvironmentFailure
from rl_async.base.types import Sample
from rl_async.engine.base import EngineError, GenerateOutput
from rl_async.loop.agent_runner import AgentRunner
from rl_async.loop.gateway import Gateway
from rl_async.loop.trajectory import TrajectoryLimits
from real_model import smollm2_tokenizer
from test_trajectories import ScriptedEngine, spans

ROW = {"id": "r1", "question": "What is 6 x 7?"}


class CalculatorAgent:
    """Asks, gets a tool result, answers: an environment with its own loop, as one written
    for an OpenAI client is. `rewrite` edits its history before the second call."""

    def __init__(self, rewrite: bool = False, max_tokens: int | None = None):
        self.rewrite, self.max_tokens, self.replies = rewrite, max_tokens, []

    async def rollout(self, row, endpoint):
        client = endpoint.openai_client()
        messages = [{"role": "system", "content": "You can call a calculator."},
                    {"role": "user", "content": row["question"]}]
        try:
            for tool in ("calculator: 6 * 7 = 42", None):
                kwargs = {"max_tokens": self.max_tokens} if self.max_tokens else {}
                r = await client.chat.completions.create(
                    model=endpoint.model, messages=messages, logprobs=True,
                    extra_body={"return_token_ids": True}, **kwargs)
                self.replies.append(r)
                content = r.choices[0].message.content
                messages.append({"role": "assistant",
                                 "content": content + (" (edited)" if self.rewrite else "")})
                if tool:
                    messages.append({"role": "tool", "content": tool})
        finally:
            await client.close()
        return 1.0 if "42" in messages[-1]["content"] else 0.0


def setup(env, replies, finish, budget=None, max_len=32):
    tok = smollm2_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = ScriptedEngine([[*tok.encode(r, add_special_tokens=False), end] if f == "stop"
                             else tok.encode(r, add_special_tokens=False)
                             for r, f in zip(replies, finish)], finish)
    gateway = Gateway("policy", tok)
    runner = AgentRunner(env, ChatRenderer(tok, (end,)),
                         TrajectoryLimits(max_len, budget, 10.0), gateway)
    return tok, engine, gateway, runner


def run(runner, engine, gateway, row=ROW):
    """One trajectory through the runner and its gateway, which is stopped afterwards."""
    sample = Sample(prompt_id="r1", metadata={"row": row, "where": "rows.jsonl:1"})

    async def go():
        try:
            return await runner.run(sample, engine)
        finally:
            await gateway.stop()
    return sample, asyncio.run(go())


def test_chat_through_a_real_openai_client_trains_exactly_the_sampled_tokens():
    env = CalculatorAgent()
    tok, engine, gateway, runner = setup(env, ["call calculator(6*7)", "It is 42."],
                                         ["stop", "stop"])
    sample, result = run(runner, engine, gateway)
    assert (result.finish, result.turns, sample.reward) == ("done", 2, 1.0)
    runs = spans(sample)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert [ids for m, ids in runs if m == 1] == engine.replies  # sampled = trained
    # Each call continued the exact tokens so far (no re-tokenization of the first reply).
    for request, _ in engine.requests:
        n = len(request) - len(sample.prompt_ids)
        assert request == sample.prompt_ids + sample.response_ids[:n]
    assert tok.decode(runs[1][1]) == ("\n<|im_start|>tool\ncalculator: 6 * 7 = 42<|im_end|>\n"
                                      "<|im_start|>assistant\n")
    # Independently: the whole sequence is the template's rendering of the conversation.
    conversation = [{"role": "system", "content": "You can call a calculator."},
                    {"role": "user", "content": ROW["question"]},
                    {"role": "assistant", "content": "call calculator(6*7)"},
                    {"role": "tool", "content": "calculator: 6 * 7 = 42"},
                    {"role": "assistant", "content": "It is 42."}]
    full = tok.apply_chat_template(conversation, tokenize=False)
    assert tok.decode(sample.prompt_ids + sample.response_ids) == full.rstrip("\n")
    # What the client saw: text, log-probs of the sampled tokens, the ids when asked.
    first = env.replies[0].choices[0]
    assert first.message.content == "call calculator(6*7)" and first.finish_reason == "stop"
    assert first.model_extra["token_ids"] == engine.replies[0]
    assert [c.logprob for c in first.logprobs.content] == [-0.5] * len(engine.replies[0])
    assert env.replies[1].model_extra["prompt_token_ids"] == engine.requests[1][0]
    assert sample.token_versions[:len(runs[0][1])] == [7] * len(runs[0][1])


def test_a_refused_call_aborts_the_trajectory_whatever_the_environment_returns():
    """A rewritten history gets HTTP 400; the environment catches it and returns a reward,
    as verifiers always does. The refusal is infrastructure, not the policy: the trajectory
    is aborted (regenerated through the ledger with the cause), never scored."""

    class Swallowing(CalculatorAgent):
        async def rollout(self, row, endpoint):
            try:
                return await super().rollout(row, endpoint)
            except openai.BadRequestError:
                return 0.0

    for env in (CalculatorAgent(rewrite=True), Swallowing(rewrite=True)):
        tok, engine, gateway, runner = setup(env, ["call calculator(6*7)", "42"],
                                             ["stop", "stop"])
        sample, result = run(runner, engine, gateway)
        assert result.finish == "abort" and sample.reward is None
        assert "message 2 differs" in result.reason and "append-only" in result.reason


def test_the_token_budget_truncates_and_calls_past_it_answer_empty():
    env = CalculatorAgent()
    tok, engine, gateway, runner = setup(env, ["call calculator(6*7)", "It is 42."],
                                         ["stop", "stop"], budget=40)
    sample, result = run(runner, engine, gateway)
    # The tool turn does not fit in 40 tokens: nothing more is generated, truncated.
    assert result.finish == "max_tokens" and result.turns == 1 and result.truncated
    assert len(sample.prompt_ids) + len(sample.response_ids) < 40
    assert env.replies[1].choices[0].finish_reason == "length"
    assert env.replies[1].choices[0].message.content == ""


def test_an_aborted_turn_aborts_the_trajectory_and_an_engine_error_is_reraised():
    _, engine, gateway, runner = setup(CalculatorAgent(), ["call", "42"], ["abort", "stop"])
    _, result = run(runner, engine, gateway)
    assert result.finish == "abort"

    async def broken(ids, n, turn):
        raise EngineError("engine 0 rejected the request: prompt too long")

    _, _, gateway, runner = setup(CalculatorAgent(), ["x"], ["stop"])
    with pytest.raises(EngineError, match="prompt too long"):
        run(runner, broken, gateway)


def test_completions_token_and_trajectory_checks():
    tok = smollm2_tokenizer()
    engine = ScriptedEngine([tok.encode(" 42", add_special_tokens=False),
                             tok.encode(" yes", add_special_tokens=False)], ["length", "length"])
    gateway = Gateway("policy", tok)
    from rl_async.loop.agent import AgentTrajectory

    traj = AgentTrajectory(ChatRenderer(tok, ()), TrajectoryLimits(8, None, 5.0), engine)

    async def go():
        endpoint = await gateway.open(traj)
        client = endpoint.openai_client()
        try:
            a = await client.completions.create(model="policy", prompt="6 x 7 =", logprobs=1)
            b = await client.completions.create(model="policy",
                                                prompt="6 x 7 =" + a.choices[0].text + ". Sure?")
            wrong = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="nope",
                                       default_headers=endpoint.headers, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
            other = openai.AsyncOpenAI(base_url=gateway.base_url, api_key=gateway.token,
                                       max_retries=0)
            with pytest.raises(openai.NotFoundError, match="no open trajectory"):
                await other.completions.create(model="policy", prompt="hi")
            with pytest.raises(openai.BadRequestError, match="n = 2"):
                await client.completions.create(model="policy", prompt="x", n=2)
            models = await client.models.list()
            await wrong.close(), await other.close()
            return a, b, [m.id for m in models.data]
        finally:
            await client.close()
            await gateway.stop()

    a, b, models = asyncio.run(go())
    assert a.choices[0].text == " 42"
    assert a.choices[0].logprobs.token_logprobs == [-0.5] * len(engine.replies[0])
    assert b.choices[0].text == " yes" and models == ["policy"]
    s = traj.sample
    # Only the new text (". Sure?") was encoded and masked; the sampled " 42" was kept.
    assert [m for m, _ in spans(s)] == [1, 0, 1]
    assert tok.decode(s.prompt_ids + s.response_ids) == "6 x 7 = 42. Sure? yes"
    assert engine.requests[1][0] == s.prompt_ids + s.response_ids[:len(engine.requests[1][0])
                                                                   - len(s.prompt_ids)]


def test_concurrent_calls_on_one_trajectory_are_refused():
    tok = smollm2_tokenizer()
    from rl_async.loop.agent import AgentTrajectory

    release = asyncio.Event()

    async def slow(ids, n, turn):
        await release.wait()
        return GenerateOutput("t", [5], [-0.5], [1], "length")

    traj = AgentTrajectory(ChatRenderer(tok, ()), TrajectoryLimits(8, None, 5.0), slow)
    gateway = Gateway("policy", tok)

    async def go():
        endpoint = await gateway.open(traj)
        client = endpoint.openai_client()
        try:
            first = asyncio.ensure_future(client.completions.create(model="p", prompt="a"))
            await asyncio.sleep(0.2)
            with pytest.raises(openai.BadRequestError, match="already in flight"):
                await client.completions.create(model="p", prompt="a")
            release.set()
            return await first
        finally:
            await client.close()
            await gateway.stop()

    assert asyncio.run(go()).choices[0].finish_reason == "length"
