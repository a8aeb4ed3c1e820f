"""Evaluation results users can compare: eval/reward, eval/pass@k, eval/mean@k.

`eval/reward` is the mean reward of one response per held-out prompt: greedy with
`eval.greedy = true` (the default), else sampled at the rollout settings. With
`eval.n_samples = k > 0`, k more responses per prompt are sampled at the rollout settings:
`eval/mean@k` is their mean reward and `eval/pass@k` the mean over prompts of the best of the
k rewards, which is the share of prompts solved at least once for 0/1 rewards (with exactly k
samples the unbiased pass@k estimator reduces to this).
"""

from __future__ import annotations

from collections.abc import Sequence


def eval_metrics(first: Sequence[float], sampled: Sequence[Sequence[float]] = ()
                 ) -> dict[str, float]:
    """`first`: one reward per prompt; `sampled`: k rewards per prompt (or nothing)."""
    out = {"reward": sum(first) / max(1, len(first))}
    if sampled:
        k = len(sampled[0])
        if any(len(s) != k for s in sampled) or k == 0:
            raise ValueError(f"eval_metrics: every prompt needs the same k > 0 samples, got "
                             f"{sorted({len(s) for s in sampled})}")
        out[f"pass@{k}"] = sum(max(s) for s in sampled) / len(sampled)
        out[f"mean@{k}"] = sum(sum(s) for s in sampled) / (k * len(sampled))
    return out
