"""verifiers environments (PyPI `verifiers`, a MultiTurnEnv and a ToolEnv written in the
tests) running their own rollout loops through the gateway: what is trained, the rubric's
reward, native tool calls, and errors inside the library."""

from __future__ import annotations


import pytest

from rl_async.algo.chat import ChatRenderer, digit_tokenizer
from rl_async.algo.environments import EnvironmentFailure
from rl_async.algo.verifiers_env import make_agent, rows
from rl_async.loop.agent_runner import AgentRunner
from rl_async.loop.gateway import Gateway
from rl_async.loop.trajectory import TrajectoryLimits
from rl_async.base.types import Sample
from rl_async.engine.base import GenerateOutput
from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from real_model import smollm2_tokenizer
from test_gateway import run
from test_trajectories import ScriptedEngine, spans


def play(agent, tok, renderer, engine, row):
    gateway = Gateway("policy", tok)
    runner = AgentRunner(agent, renderer, TrajectoryLimits(64, None, 20.0), gateway)
    return run(runner, engine, gateway, row)


def test_a_multiturn_env_plays_through_the_gateway_and_its_rubric_is_the_reward():
    agent = make_agent("vf_digits")
    row = rows(agent.env, "train")[0]       # digits [0, 0]: show 0, then 0, answer 0
    assert row["prompt"] == [{"role": "user", "content": "0"}]
    tok = digit_tokenizer()
    d = lambda s: tok.convert_tokens_to_ids(s)  # noqa: E731
    engine = ScriptedEngine([[d("7"), d("</s>")], [d("0"), d("</s>")]], ["stop", "stop"])
    sample, result = play(agent, tok, ChatRenderer(tok, (d("</s>"),)), engine, row)
    assert (result.finish, result.turns, sample.reward) == ("done", 2, 1.0)
    runs = spans(sample)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert tok.decode(sample.prompt_ids) == "<s>0|"
    assert tok.decode(runs[1][1]) == "0|"      # the env's message, masked
    assert [ids for m, ids in runs if m] == engine.replies
    assert agent.max_turns == 2


def test_a_tool_env_gets_native_tool_calls_and_the_tool_result_is_context():
    agent = make_agent("vf_calculator")
    row = rows(agent.env, "train")[0]       # What is 6 + 5?
    tok = smollm2_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 6, "b": 5}}\n</tool_call>'
    engine = ScriptedEngine([tok.encode(call, add_special_tokens=False) + [end],
                             tok.encode("11", add_special_tokens=False) + [end]],
                            ["stop", "stop"])
    sample, result = play(agent, tok, ChatRenderer(tok, (end,)), engine, row)
    assert (result.turns, sample.reward) == (2, 1.0)
    runs = spans(sample)
    assert [m for m, _ in runs] == [1, 0, 1]
    assert [ids for m, ids in runs if m] == engine.replies   # the call block is trained as sampled
    masked = tok.decode(runs[1][1])
    assert "<|im_start|>tool\n11<|im_end|>" in masked        # the tool ran; its result is context


def test_an_error_inside_the_verifiers_rollout_fails_the_group_with_it():
    agent = make_agent("vf_digits", {"fail": True})
    tok = digit_tokenizer()
    d = lambda s: tok.convert_tokens_to_ids(s)  # noqa: E731
    engine = ScriptedEngine([[d("7"), d("</s>")], [d("0"), d("</s>")]], ["stop", "stop"])
    with pytest.raises(EnvironmentFailure, match="the game's server is down"):
        play(agent, tok, ChatRenderer(tok, (d("</s>"),)), engine, rows(agent.env, "train")[0])


def test_validate_a_verifiers_run():
    def errors(*sets):
        return validate(load_config("cluster_configs/multiturn.toml", [
            "task.name=verifiers", "task.env=vf_digits", "task.path=", "task.env_args={}",
            *sets])).errors

    assert errors() == []
    assert any("verifiers could not load it" in e for e in errors("task.env=vf_nowhere"))
    assert any("rubric) is the reward" in e
               for e in errors("reward.function=rl_async.algo.tasks:successor_reward"))


def test_loading_off_the_main_thread_leaves_the_process_signal_handlers_alone():
    import signal
    import threading

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    loaded = []
    t = threading.Thread(target=lambda: loaded.append(make_agent("vf_digits")))
    t.start()
    t.join(60)
    assert loaded and loaded[0].max_turns == 2  # as in a Ray actor's thread
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_an_empty_reply_is_the_policys_outcome_and_is_trained_with_reward_0():
    # verifiers ends a rollout whose reply is empty with EmptyModelResponseError (a
    # ModelError): the policy did it, so the trajectory is trained, not the group failed.
    agent = make_agent("vf_digits")
    tok = digit_tokenizer()
    d = lambda s: tok.convert_tokens_to_ids(s)  # noqa: E731
    engine = ScriptedEngine([[d("</s>")]], ["stop"])
    sample, result = play(agent, tok, ChatRenderer(tok, (d("</s>"),)), engine,
                          rows(agent.env, "train")[0])
    assert (result.turns, sample.reward, agent.policy_errors) == (1, 0.0, 1)
    assert sample.response_ids == [d("</s>")] and sample.loss_mask == [1]


def test_lazily_built_datasets_are_the_train_and_eval_rows():
    agent = make_agent("vf_group")
    assert agent.env.dataset is None and agent.env.eval_dataset is None  # builders, unbuilt
    assert [r["answer"] for r in rows(agent.env, "train")] == ["0", "1", "2", "3", "4"]
    assert [r["answer"] for r in rows(agent.env, "eval")] == ["5", "6", "7", "8", "9"]


def test_a_group_reward_rubric_scores_the_group_in_one_run_group_call():
    """Three trajectories of one row, each through its own gateway trajectory; the rubric's
    group function sees all three (the only right one gets its bonus)."""
    import asyncio

    from rl_async.loop.trajectory import GroupSlot

    agent = make_agent("vf_group")
    assert agent.group_scored
    row = rows(agent.env, "train")[3]       # answer "3"
    tok = digit_tokenizer()
    d = lambda s: tok.convert_tokens_to_ids(s)  # noqa: E731
    replies = {0: [d("3"), d("</s>")], 1: [d("7"), d("</s>")], 2: [d("1"), d("</s>")]}
    gateway = Gateway("policy", tok)
    runner = AgentRunner(agent, ChatRenderer(tok, (d("</s>"),)),
                         TrajectoryLimits(8, None, 20.0), gateway)

    async def go():
        samples = [Sample(prompt_id="p", metadata={"row": row, "where": "vf"}) for _ in range(3)]

        def engine(i):
            async def generate(ids, n, turn):
                return GenerateOutput(f"{i}", replies[i], [-0.5] * 2, [1, 1], "stop")
            return generate

        try:
            results = await asyncio.gather(*(runner.run(s, engine(i), GroupSlot("g", i, 3))
                                             for i, s in enumerate(samples)))
        finally:
            await gateway.stop()
        return samples, results

    samples, results = asyncio.run(go())
    assert [s.reward for s in samples] == [1.5, 0.0, 0.0]
    assert [s.response_ids for s in samples] == [replies[0], replies[1], replies[2]]
    assert all(r.finish == "done" for r in results)


def test_infrastructure_errors_are_judged_by_the_chain_and_abort():
    from rl_async.algo.verifiers_env import judge_error

    chain = lambda s: {"error": s.split(" -> ")[0], "message": "m",  # noqa: E731
                       "error_chain_repr": s, "error_chain_str": s}
    assert judge_error(chain("EmptyModelResponseError")) == "policy"
    assert judge_error(chain("ModelError -> BadRequestError")) == "infrastructure"
    assert judge_error(chain("ModelError -> APIConnectionError")) == "infrastructure"
    assert judge_error(chain("ToolCallError -> SandboxError")) == "infrastructure"
    assert judge_error(chain("RuntimeError")) == "bug"


def test_a_refused_call_inside_verifiers_aborts_instead_of_training_reward_0():
    """verifiers catches the gateway's 400 (ModelError from BadRequestError) and scores the
    rollout 0: before, that was trained as the policy's outcome."""
    agent = make_agent("vf_digits")
    tok = digit_tokenizer()
    d = lambda s: tok.convert_tokens_to_ids(s)  # noqa: E731
    engine = ScriptedEngine([[d("7"), d("</s>")], [d("0"), d("</s>")]], ["stop", "stop"])
    agent.sampling_args = {"max_tokens": 2, "stop": ["x"] * 5}  # 5 stops: refused by name
    sample, result = play(agent, tok, ChatRenderer(tok, (d("</s>"),)), engine,
                          rows(agent.env, "train")[0])
    assert result.finish == "abort" and "stop = " in result.reason and sample.reward is None
