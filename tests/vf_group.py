"""A verifiers MultiTurnEnv written for the tests with what per-trajectory run_rollout could not
serve: a group reward function (each rollout scored against its siblings: 1 for a correct
answer, plus 0.5 when it is the only correct one of its group) and lazily built datasets
(DatasetBuilder callables: the datasets stay None until built). Loaded by
`verifiers.load_environment("vf_group")` (the tests directory is on the path)."""

import verifiers as vf
from datasets import Dataset


class Recall(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


def load_environment():
    def build(split: str):
        def builder():
            first = 0 if split == "train" else 5
            return Dataset.from_list([{"question": str(d), "answer": str(d)}
                                      for d in range(first, first + 5)])
        return builder

    def relative(completions, answers, **_) -> list[float]:
        right = [bool(c) and (c[-1]["content"] if isinstance(c[-1], dict)
                              else c[-1].content or "").strip()[:1] == a
                 for c, a in zip(completions, answers)]
        alone = sum(right) == 1
        return [float(r) + (0.5 if r and alone else 0.0) for r in right]

    return Recall(dataset=build("train"), eval_dataset=build("eval"),
                  rubric=vf.Rubric(funcs=[relative]), max_turns=1)
