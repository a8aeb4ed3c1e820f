"""What the OpenAI-compatible gateway costs an agent, against token-in/token-out direct on the
same engine, measured side by side in one run.

The same scripted episode runs both ways on one embedded engine (in this process): a user
question, then `turns` assistant turns of `--reply` tokens each (greedy, no stop token, so
both sides sample exactly the same tokens), each followed by a short user message.
- direct: our protocol (reset/step/score) through rl_async.loop.trajectory, the engine called
  with the token ids;
- gateway: the same game as an agent (`rollout(row, endpoint)`), its loop calling the model
  with the real `openai` client over loopback HTTP (rl_async.loop.gateway), which renders
  each call's new messages and keeps the tokens;
- gateway_http: the same agent posting plain JSON with httpx: the gateway's own cost without
  the openai SDK's per-call request transformation (which grows with the conversation).
`--trajectories` of them run concurrently per side (a group in flight), at 8, 32 and 128
turns, sides alternated per repeat, median per side. The chat template is SmolLM2's real
one; the model is a tiny random Llama over its vocabulary (`--model smollm2`: the real
SmolLM2-135M-Instruct, whose turns cost more engine time, so the same overhead is a smaller
share).

    python benchmarks/gateway_overhead.py --json [--model smollm2] [--repeat N]
prints one JSON line {"turns", "direct_seconds", "gateway_seconds", "gateway_http_seconds",
"overhead", "overhead_http", ...}: overhead = gateway / direct - 1 per turn count (and
overhead_http the same for plain HTTP); "overhead_at_max_turns" is the figure at 128 turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from _smoke import parse_with_smoke
from rl_async.algo.chat import ChatRenderer
from rl_async.base.types import Sample
from rl_async.engine.base import SamplingParams
from rl_async.engine.embedded import EmbeddedEngine, EmbeddedEngineConfig
from rl_async.loop.agent_runner import AgentRunner
from rl_async.loop.gateway import Gateway
from rl_async.loop.trajectory import TrajectoryLimits, TrajectoryRunner
from rl_async.state.models import tiny_llama_config
from rl_async.state.prepare_model import prepare_model


SIDES = ("direct", "gateway", "gateway_http")


def user_turn(k: int) -> dict:
    return {"role": "user", "content": f"Result {k}: ok. Next?"}


class Script:
    """Our protocol: the question, then a user message after every reply."""

    def __init__(self, turns: int):
        self.max_turns = turns

    async def reset(self, row):
        return [{"role": "user", "content": "Count with me."}], {"turn": 0}

    async def step(self, messages, state):
        state["turn"] += 1
        return [user_turn(state["turn"])], state["turn"] == self.max_turns

    async def score(self, messages, state):
        return 1.0


class ScriptAgent:
    """The same script as an agent with an OpenAI client."""

    def __init__(self, turns: int):
        self.max_turns = turns

    async def rollout(self, row, endpoint):
        client = endpoint.openai_client()
        messages = [{"role": "user", "content": "Count with me."}]
        try:
            for k in range(1, self.max_turns + 1):
                reply = await client.chat.completions.create(model=endpoint.model,
                                                             messages=messages)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             user_turn(k)]
        finally:
            await client.close()
        return 1.0


class HttpScriptAgent(ScriptAgent):
    """The same script posting plain JSON (httpx, no SDK): what the gateway itself costs,
    without the openai client's own per-call work (it re-validates and transforms every
    message of the request body, O(conversation) per call)."""

    async def rollout(self, row, endpoint):
        http = endpoint.http_client
        url = f"{endpoint.base_url}/chat/completions"
        auth = {"Authorization": f"Bearer {endpoint.api_key}"}
        messages = [{"role": "user", "content": "Count with me."}]
        for k in range(1, self.max_turns + 1):
            reply = await http.post(url, headers=auth,
                                    json={"model": endpoint.model, "messages": messages})
            reply.raise_for_status()
            content = reply.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": content}, user_turn(k)]
        return 1.0


def build(model: str, max_tokens: int):
    from transformers import AutoTokenizer

    folder = prepare_model("smollm2")
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model_args = ({"path": str(folder)} if model == "smollm2" else {"hf_config": tiny_llama_config(
        vocab_size=len(tok), max_position_embeddings=max_tokens + 64)})
    return tok, EmbeddedEngine(EmbeddedEngineConfig(
        **model_args, max_running_requests=64, torch_threads=2,
        max_total_tokens=64 * (max_tokens + 64)))


async def one_side(side: str, engine, renderer, turns: int, reply: int, n: int) -> float:
    budget = 16 + turns * (reply + 24) + 64
    limits = TrajectoryLimits(reply, budget, 600.0)

    async def generate(ids, max_new_tokens, turn):
        return await engine.generate(ids, SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=()))

    gateway = Gateway("policy", renderer.tokenizer) if side != "direct" else None
    agent = ScriptAgent(turns) if side == "gateway" else HttpScriptAgent(turns)
    runner = (AgentRunner(agent, renderer, limits, gateway) if gateway
              else TrajectoryRunner(Script(turns), renderer, limits))
    samples = [Sample(prompt_id=f"p{i}", metadata={"row": {}}) for i in range(n)]
    if gateway is not None:
        await gateway.start()  # bound once per run, as in a producer
    start = time.perf_counter()
    results = await asyncio.gather(*(runner.run(s, generate) for s in samples))
    seconds = time.perf_counter() - start
    if gateway is not None:
        await gateway.stop()
    assert all(r.turns == turns for r in results), [r.finish for r in results]
    return seconds


async def measure(args) -> dict:
    tok, engine = build(args.model, 16 + max(args.turns) * (args.reply + 24) + 64)
    renderer = ChatRenderer(tok, ())
    out = {"turns": args.turns, **{f"{s}_seconds": [] for s in SIDES},
           "overhead": [], "overhead_http": []}
    try:
        for side in SIDES:  # warm every path
            await one_side(side, engine, renderer, 2, args.reply, 2)
        for turns in args.turns:
            times = {s: [] for s in SIDES}
            for r in range(args.repeat):
                for side in SIDES[r % 3:] + SIDES[:r % 3]:  # rotate who goes first
                    times[side].append(await one_side(side, engine, renderer, turns,
                                                      args.reply, args.trajectories))
            med = {s: statistics.median(times[s]) for s in SIDES}
            for s in SIDES:
                out[f"{s}_seconds"].append(round(med[s], 4))
            out["overhead"].append(round(med["gateway"] / med["direct"] - 1, 4))
            out["overhead_http"].append(round(med["gateway_http"] / med["direct"] - 1, 4))
    finally:
        await engine.close()
    out["overhead_at_max_turns"] = out["overhead"][-1]
    out["overhead_http_at_max_turns"] = out["overhead_http"][-1]
    out.update(model=args.model, reply_tokens=args.reply, trajectories=args.trajectories,
               repeat=args.repeat, torch_threads=torch.get_num_threads())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--reply", type=int, default=8, help="tokens per assistant turn")
    parser.add_argument("--trajectories", type=int, default=8, help="concurrent, per side")
    parser.add_argument("--repeat", type=int, default=3)
    args = parse_with_smoke(parser, turns=[2, 4], trajectories=2, repeat=1, reply=2)
    out = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(out))
    else:
        for i, t in enumerate(out["turns"]):
            print(f"{t:4d} turns: direct {out['direct_seconds'][i]:.3f} s, gateway (openai "
                  f"client) {out['gateway_seconds'][i]:.3f} s ({out['overhead'][i]:+.1%}), "
                  f"gateway (plain HTTP) {out['gateway_http_seconds'][i]:.3f} s "
                  f"({out['overhead_http'][i]:+.1%})")


if __name__ == "__main__":
    main()
