"""Math answers verified by math-verify (Hugging Face's library for exactly this: LaTeX and
plain answers, compared by mathematical equivalence, not by string): the reward of
`task.name = "math"` (JSONL rows with an `answer`), installed with the `math` extra
(`pip install -e '.[math]'`; `validate` refuses the task without it).

    \\boxed{\\frac{1}{2}} == 0.5 == 1/2,  \\boxed{3.0} == 3,  1,000 == 1000,  5\\text{ cm} == 5

Plain answers keep the last-number reward (`rl_async.algo.tasks:answer_match_reward`).
math-verify's own timeouts use SIGALRM, which works only on a process's main thread. Under
`reward.isolation = "process"` (the default) each call runs on a reward worker's main thread:
the timeouts are on (MATH_VERIFY_TIMEOUT_S each for parsing and comparing; an answer sympy
cannot settle in time scores 0, as math-verify decides), and `reward.timeout_s` kills the
worker if a call still hangs. In a worker thread (`"thread"`) they cannot be used.
"""

from __future__ import annotations

import importlib.util
import threading

from rl_async.base.types import Sample

EXTRA = "math-verify (pip install -e '.[math]')"
MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own default, per parse and per comparison


def _own_timeout() -> int | None:
    """math-verify's SIGALRM timeout where it works (a main thread), else None (off)."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() \
        else None


def available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def _parse(text: str):
    from math_verify import parse

    return parse(text, parsing_timeout=_own_timeout())


def math_reward(sample: Sample) -> float:
    """1.0 when the decoded response's final answer equals the row's `answer`
    mathematically (math-verify), else 0.0; a gold answer it cannot read is an error."""
    from math_verify import verify

    text = sample.metadata.get("response_text")
    if text is None or "answer" not in sample.metadata:
        raise KeyError(f"prompt {sample.prompt_id!r}: math_reward needs metadata 'answer' and "
                       f"a decoded 'response_text' (set model.path)")
    answer = str(sample.metadata["answer"]).strip()
    # A bare gold answer parses as an expression; LaTeX without delimiters needs $...$.
    gold = _parse(answer) or _parse(f"${answer}$")
    if not gold:
        raise ValueError(f"prompt {sample.prompt_id!r}: math-verify cannot read its answer "
                         f"{answer!r}; fix the row's `answer`")
    predicted = _parse(text)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=_own_timeout()))
