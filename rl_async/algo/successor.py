"""The built-in verifiable task, "successor", and its long-tailed variant.

The prompt is `BOS d1 .. dk` (k = task.prompt_digits digits in [0, modulus)); the answer is
(dk + 1) mod modulus. The leading digits are distractors, so the policy must learn to read
the right position and apply the rule; a tenth of the digit strings (digit sum a multiple
of 10) is held out for evaluation, so the eval reward measures generalisation to unseen
prompts, not memorisation. A random tiny model starts near 1/vocab and RL lifts it close to
1.0 in a few dozen updates on a CPU.

`task.count_tokens = C > 0` makes response lengths vary by prompt, the long tail that makes
asynchronous RL pay (a synchronous collection waits for its longest response): the response
keeps counting from the last digit, `n` tokens, each the successor of the one before (mod
modulus), where n in [2, C] is a function of the prompt's leading digits only (so every
answer digit meets every n, in training and held out). Each prompt's response budget is
exactly n (its `max_new_tokens`) and the reward is the share of the n tokens counted right
before the first mistake, so every position has its own clean signal. C = 16 gives lengths
2..16, 8x the shortest. C = 0 is the plain task (n = 1).
"""

from __future__ import annotations

from rl_async.algo.rewards import inline_safe
from rl_async.algo.tasks import BOS, DIGIT0, DatasetError, Prompt
from rl_async.base.types import Sample


def count_of(digits: list[int], modulus: int, count_tokens: int) -> int:
    """n in [2, count_tokens] from the leading digits (never the last, the answer's)."""
    lead = 0
    for d in digits[:-1]:
        lead = lead * modulus + d
    # x7 spreads neighbouring digit strings over the lengths.
    return 2 + (lead * 7) % (count_tokens - 1)


def successor_prompts(modulus: int, vocab_size: int, digits: int = 3, split: str = "train",
                      count_tokens: int = 0) -> list[Prompt]:
    """All `modulus ** digits` digit strings. Strings whose digit sum is a multiple of 10 are
    the held-out eval split: every answer digit occurs there, with unseen leading digits."""
    if DIGIT0 + modulus > vocab_size:
        raise DatasetError(
            f"task.modulus = {modulus} needs a vocabulary of at least {DIGIT0 + modulus} tokens "
            f"(4 specials + digits); model.hf_config.vocab_size = {vocab_size}")
    prompts = []
    for index in range(modulus ** digits):
        ds = [(index // modulus ** i) % modulus for i in reversed(range(digits))]
        if (sum(ds) % 10 == 0) != (split == "eval"):
            continue
        meta = {"answer_ids": [DIGIT0 + (ds[-1] + 1) % modulus]}
        if count_tokens:
            n = count_of(ds, modulus, count_tokens)
            meta.update(count=n, modulus=modulus, max_new_tokens=n)
        prompts.append(Prompt(prompt_id="succ" + "-".join(map(str, ds)),
                              prompt_ids=[BOS] + [DIGIT0 + d for d in ds], metadata=meta))
    return prompts


@inline_safe
def successor_reward(sample: Sample) -> float:
    """Plain: 1.0 when the response starts with the answer token(s), else 0.0. Counting
    (metadata `count` = n): the share of the first n tokens that count on from the answer
    before the first mistake (a response cut short scores what it counted)."""
    answer = list(sample.metadata["answer_ids"])
    n = sample.metadata.get("count")
    if n is None:
        return 1.0 if list(sample.response_ids[: len(answer)]) == answer else 0.0
    modulus, want, right = int(sample.metadata["modulus"]), answer[0], 0
    for token in sample.response_ids[:n]:
        if token != want:
            break
        right += 1
        want = DIGIT0 + (want - DIGIT0 + 1) % modulus
    return right / n
