"""`plan --simulate`'s GPU split advice (rl_async/sim/split.py) on the 8-GPU node file: the
side that bounds the simulated loop gets GPUs from the other, and the named split is one
that validates and simulates faster."""

import re
from pathlib import Path

import pytest

from rl_async.plan.checks import validate
from rl_async.plan.load import load_config
from rl_async.sim.advice import simulated_warnings

ROOT = Path(__file__).resolve().parents[2]
NODE = str(ROOT / "cluster_configs" / "node.toml")
LOCAL = str(ROOT / "cluster_configs" / "local.toml")
STEPS = 6


def advice(path, *overrides):
    cfg = load_config(path, overrides)
    base, warnings = simulated_warnings(path, overrides, cfg, steps=STEPS)
    split = [w for w in warnings if w.code == "SIM_GPU_SPLIT"]
    return base, (split[0].message if split else None)


def named_split(message):
    return tuple(int(x) for x in re.search(
        r"cluster.inference_gpus=(\d+) --set cluster.trainer_gpus=(\d+)", message).groups())


# The file's batch (32 groups, 128 samples per step) splits over 1, 2, 4 or 8 trainer ranks
# only; 24 groups and 96-sample steps also split over 6 (and 3).
SIX_WAY = ("rollout.rollout_batch_size=24", "train.global_batch_size=96")


@pytest.mark.parametrize("train_seconds, extra, more", [
    ("0.0005", (), "engines"),     # the trainer waits on generation: lend it engines
    ("0.5", SIX_WAY, "trainer"),   # engines idle behind a slow trainer: lend it GPUs
])
def test_the_bound_side_gets_gpus_and_the_named_split_is_valid(train_seconds, extra, more):
    overrides = (f"synthetic.train_seconds_per_sample={train_seconds}", *extra)
    base, message = advice(NODE, *overrides)
    assert message is not None, base
    inference, trainer = named_split(message)
    assert inference + trainer == 8
    assert (inference > 4) if more == "engines" else (trainer > 4)
    cfg = load_config(NODE, (*overrides, f"cluster.inference_gpus={inference}",
                             f"cluster.trainer_gpus={trainer}",
                             f"cluster.trainer_workers={trainer}"))
    assert validate(cfg).ok
    faster = float(re.search(r"simulate (\d+) steps/hour", message).group(1))
    assert faster >= 1.05 * base["steps_per_hour"]
    assert "1 / trainer GPUs" in message  # the assumption is said


def test_splits_that_do_not_validate_are_never_advised():
    """A slow trainer, but no larger trainer divides the file's batch (5, 6, 7 ranks): the
    only other valid split (6 + 2) is slower, so nothing is advised."""
    _, message = advice(NODE, "synthetic.train_seconds_per_sample=0.5")
    assert message is None


def test_no_split_advice_on_cpu():
    _, message = advice(LOCAL, "run.max_steps=4")
    assert message is None
