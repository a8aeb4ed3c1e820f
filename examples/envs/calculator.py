"""A calculator tool for a real chat model (SPEC §12 protocol): the model may write
`CALC: <expression>` to use the tool; the environment answers with a `tool` message holding
the result; a reply without a call is the final answer, scored against the row's `answer`.
With `hint = true`, a first reply without a call gets the tool's result anyway (the
environment runs the calculator on the question's expression) and one more turn to answer,
so every trajectory has a tool turn even before the model learns to call it.

Rows: any JSONL with `prompt` (the question) and `answer`, e.g. data/arith/*.jsonl. On the
real SmolLM2 model (docs/environments.md, "The demo"):
    rl-async run cluster_configs/smollm2.toml --set task.name=env \\
        --set task.env=examples/envs/calculator.py:make_env --set 'task.env_args={hint = true}' \\
        --set rollout.max_trajectory_tokens=192 --set rollout.max_response_len=12
"""

from __future__ import annotations

import ast
import operator
import re

SYSTEM = ("You can use a calculator. To use it, reply with exactly `CALC: <expression>` "
          "and you will get the result. Otherwise reply with just the final number.")
CALL = re.compile(r"CALC:\s*([0-9+\-*/(). ]+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_EXPRESSION = re.compile(r"\d+(?:\s*[-+*/]\s*\d+)+")


def evaluate(expression: str) -> str:
    """Arithmetic only (never eval): + - * / and parentheses over numbers."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError("not arithmetic")
    try:
        value = walk(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return "error"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class Calculator:
    def __init__(self, max_turns: int = 3, hint: bool = False):
        self.max_turns, self.hint = max_turns, hint

    async def reset(self, row: dict):
        return ([{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": row["prompt"]}],
                {"answer": str(row["answer"]).strip(), "calls": 0, "hinted": False,
                 "question": row["prompt"]})

    async def step(self, messages: list[dict], state: dict):
        call = CALL.search(messages[-1]["content"])
        if call is None:
            expression = _EXPRESSION.search(state["question"])
            if not self.hint or state["hinted"] or expression is None:
                return [], True  # a final answer
            state["hinted"] = True  # the tool's result, unasked: answer again with it
            text = expression.group(0)
            return [{"role": "tool", "content": f"calculator: {text} = {evaluate(text)}"}], False
        state["calls"] += 1
        return [{"role": "tool", "content": evaluate(call.group(1))}], False

    async def score(self, messages: list[dict], state: dict) -> float:
        last = messages[-1]
        if last["role"] != "assistant" or CALL.search(last["content"]):
            return 0.0  # truncated before answering
        numbers = _NUMBER.findall(last["content"])
        return 1.0 if numbers and numbers[-1] == state["answer"] else 0.0


def make_env(max_turns: int = 3, hint: bool = False) -> Calculator:
    return Calculator(max_turns, hint)
