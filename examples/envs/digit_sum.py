"""A multi-turn game for the CPU demo (cluster_configs/multiturn.toml): the environment reveals
one digit per turn and, after the last one, the policy must answer a rule of all of them:
"first" (the demo: recall the first digit across a distractor turn), "first_plus_one", or
"sum" (mod 10). The first turns' answers are free (nothing is scored but the last), so the
policy learns to carry what earlier turns showed through its own replies to the end.

Rows (data/digit_sum/*.jsonl): {"id": "...", "digits": [3, 8]}. The protocol (SPEC §12):
reset, step, score and max_turns; async, as the producer awaits them.
"""

from __future__ import annotations

import asyncio


RULES = {"sum": lambda ds: sum(ds) % 10, "first": lambda ds: ds[0],
         "first_plus_one": lambda ds: (ds[0] + 1) % 10}


class DigitSum:
    def __init__(self, digits: int = 2, rule: str = "sum", delay_s: float = 0.0):
        if rule not in RULES:
            raise ValueError(f"rule = {rule!r}: one of {sorted(RULES)}")
        self.max_turns = digits  # one assistant turn per revealed digit
        self.rule = RULES[rule]
        # Seconds each step waits (no CPU): a slower environment, for measuring what an
        # environment's latency does to an async run (docs/environments.md, the demo).
        self.delay_s = delay_s

    async def reset(self, row: dict):
        digits = [int(d) for d in row["digits"]]
        if len(digits) != self.max_turns:
            raise ValueError(f"row {row.get('id')!r} has {len(digits)} digits, the game "
                             f"plays {self.max_turns}")
        return [{"role": "user", "content": str(digits[0])}], {"digits": digits, "shown": 1}

    async def step(self, messages: list[dict], state: dict):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if state["shown"] == len(state["digits"]):
            return [], True  # the answer is in; nothing more to reveal
        state["shown"] += 1
        return [{"role": "user", "content": str(state["digits"][state["shown"] - 1])}], False

    async def score(self, messages: list[dict], state: dict) -> float:
        answer = messages[-1]["content"].strip() if messages[-1]["role"] == "assistant" else ""
        target = str(self.rule(state["digits"]))
        return 1.0 if answer[:1] == target else 0.0


def make_env(digits: int = 2, rule: str = "sum", delay_s: float = 0.0) -> DigitSum:
    return DigitSum(digits, rule, delay_s)


class DigitSumAgent:
    """The same game as an agent environment: it runs its own loop and calls the model through
    the run's OpenAI-compatible gateway (rl_async.loop.agent), the way an environment written
    for an OpenAI client does. Same rows, rules and rewards as DigitSum."""

    def __init__(self, digits: int = 2, rule: str = "sum"):
        self.game = DigitSum(digits, rule)
        self.max_turns = digits

    async def rollout(self, row: dict, endpoint) -> float:
        client = endpoint.openai_client()
        try:
            messages, state = await self.game.reset(row)
            while True:
                reply = await client.chat.completions.create(model=endpoint.model,
                                                             messages=messages)
                messages.append({"role": "assistant",
                                 "content": reply.choices[0].message.content})
                new, done = await self.game.step(messages, state)
                if done:
                    return await self.game.score(messages, state)
                messages.extend(new)
        finally:
            await client.close()


def make_agent_env(digits: int = 2, rule: str = "sum") -> DigitSumAgent:
    return DigitSumAgent(digits, rule)
