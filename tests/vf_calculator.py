"""A verifiers ToolEnv written for the tests: arithmetic questions and an `add` tool the model
calls with native tool calls (Hermes <tool_call> blocks, parsed by the gateway)."""

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def load_environment():
    dataset = Dataset.from_list([{"question": f"What is {a} + {b}?", "answer": str(a + b)}
                                 for a in range(6, 9) for b in range(5, 9)])

    def correct(completion, answer, **_) -> float:
        last = completion[-1]
        text = last["content"] if isinstance(last, dict) else last.content
        return 1.0 if (text or "").strip() == answer else 0.0

    return vf.ToolEnv(tools=[add], dataset=dataset, rubric=vf.Rubric(funcs=[correct]),
                      max_turns=3)
