"""The error messages the guide quotes (troubleshooting.md, environment-api.md,
bring-your-own.md) are the ones the code raises: each quoted fragment is in its page and in
the product's source, so a reworded message fails here until the page follows it."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "\n".join(p.read_text() for d in ("rl_async", "actors", "launch")
                   for p in (ROOT / d).rglob("*.py"))
# f-strings split a message across literals: compare with the source's literal text only.
LITERALS = re.sub(r"\"\s*\n\s*f?\"|'\s*\n\s*f?'", "", SOURCE)

QUOTED = {
    "troubleshooting.md": [
        ": unknown key",
        "grades answers with",
        "weights are published over NCCL (both on GPU) or gloo (both on CPU); put trainers "
        "and engines on the same kind of device",
        "must divide the collection of rollout.rollout_batch_size x "
        "rollout.n_samples_per_prompt",
        "groups must be a multiple of the",
        "it does not fit; lower train.max_tokens_per_microbatch or train.micro_batch_size",
        "cannot import module",
        "the cluster cannot place the",
        "restarts are used up; causes:",
        "not healthy after startup_timeout_s",
        "stalled: no group reached the buffer and no optimizer step finished for",
        "an engine or the collective group is hung",
        "groups failed (more than run.max_failed_group_fraction",
        "updates in a row, more than train.max_nonfinite_updates",
        "each was skipped. Lower train.lr, check the rewards, or use float32 (model.dtype)",
    ],
    "environment-api.md": [
        "took more than task.env_timeout_s",
        "(the call was cancelled)",
        "the conversation must end with a message the policy answers (user or tool)",
        ": expected (new_messages, done: bool)",
    ],
    "bring-your-own.md": ["cannot import module"],
}


@pytest.mark.parametrize("page", sorted(QUOTED))
def test_quoted_messages_are_the_codes_own(page):
    text = " ".join((ROOT / "docs" / page).read_text().split())
    stale = [m for m in QUOTED[page] if m not in text]
    assert not stale, f"docs/{page} no longer quotes: {stale}"
    gone = [m for m in QUOTED[page] if m not in LITERALS]
    assert not gone, f"docs/{page} quotes messages the code no longer has: {gone}"
