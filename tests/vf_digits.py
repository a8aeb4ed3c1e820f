"""A verifiers MultiTurnEnv written for the tests: the demo's digit game (show a digit, then a
second one, answer the first), on the rows of data/digit_sum. Loaded by
`verifiers.load_environment("vf_digits")` (the tests directory is on the path)."""

import json
from pathlib import Path

import verifiers as vf
from datasets import Dataset

ROWS = Path(__file__).resolve().parents[1] / "data" / "digit_sum" / "rows.jsonl"


class DigitRecall(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        if self.fail:
            raise RuntimeError("the game's server is down")
        return [{"role": "user", "content": str(state["info"]["second"])}]


def load_environment(fail: bool = False, rows: int = 100):
    lines = ROWS.read_text().splitlines()[:rows]
    data = [json.loads(line)["digits"] for line in lines]
    dataset = Dataset.from_list([{"question": str(a), "answer": str(a), "info": {"second": b}}
                                 for a, b in data])

    def recalled(completion, answer, **_) -> float:
        if not completion:
            return 0.0
        last = completion[-1]
        text = last["content"] if isinstance(last, dict) else last.content
        return 1.0 if (text or "").strip()[:1] == answer else 0.0

    env = DigitRecall(dataset=dataset, rubric=vf.Rubric(funcs=[recalled]), max_turns=2)
    env.fail = fail
    return env
