"""How a publication's deadline (`publication.timeout_s`) is shared out, in one place: what
validate requires of it and what the fleet gives each engine's receive.

    publication.timeout_s  >  2 x drain_timeout_s        in-flight requests finish, or are
                                                         aborted and drained again
                            + channel_timeout_s          forming a replacement's channel
                            + channel_timeout_s          outwaiting one hung engine's bucket
                            + transfer estimate          engines x model bytes / bytes_per_s

Each engine's whole receive gets `engine_receive_budget_s`: one channel deadline per bucket,
capped by what the deadline leaves after the drains and the channel forming. An engine that
is alive but too slow is therefore lost (and restarted) before the publication deadline
would stop the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl_async.plan.capacity import CapacityPlan
    from rl_async.plan.config import PublicationSection, RunConfig


def transfer_budget_s(p: PublicationSection) -> float:
    """What the publication deadline leaves for sending, after two drains and forming a
    replacement's channel."""
    return p.timeout_s - 2 * p.drain_timeout_s - p.channel_timeout_s


def engine_receive_budget_s(p: PublicationSection, buckets: int) -> float:
    """The deadline of one engine's whole receive (trainer and engine side alike)."""
    return max(min(buckets * p.channel_timeout_s, transfer_budget_s(p)), p.channel_timeout_s)


def model_bytes(cfg: RunConfig) -> int | None:
    """Bytes one engine receives (parameters in model.dtype), where the architecture is known."""
    from rl_async.plan.memory import REQUIRED, Dims, architecture

    arch, _ = architecture(cfg)
    if arch is None or any(k not in arch for k in REQUIRED):
        return None
    return Dims.from_config(arch).params * (2 if cfg.model.dtype in ("bfloat16", "float16")
                                            else 4)


def transfer_estimate_s(cfg: RunConfig, plan: CapacityPlan) -> float | None:
    """Seconds to send the model to every engine: trainer rank 0 sends it once per engine
    (one channel each), all through its own link at publication.bytes_per_s."""
    nbytes = model_bytes(cfg)
    if nbytes is None or cfg.engine.backend == "synthetic":
        return None
    return plan.engines * nbytes / cfg.publication.bytes_per_s


def publication_errors(cfg: RunConfig, plan: CapacityPlan) -> list[str]:
    p = cfg.publication
    transfer = transfer_estimate_s(cfg, plan) or 0.0
    need = 2 * p.drain_timeout_s + 2 * p.channel_timeout_s + transfer
    if p.timeout_s > need:
        return []
    send = (f" + the transfer {transfer:.0f} ({plan.engines} engines x "
            f"{model_bytes(cfg) / 1e9:.2f} GB at publication.bytes_per_s = "
            f"{p.bytes_per_s:.3g})" if transfer >= 1 else "")  # a tiny model's is noise
    return [f"publication.timeout_s = {p.timeout_s:g} must exceed 2 x "
            f"publication.drain_timeout_s + 2 x publication.channel_timeout_s = "
            f"{2 * p.drain_timeout_s:g} + {2 * p.channel_timeout_s:g}{send} = {need:.0f} "
            f"(drain, abort and drain again, form a replacement's channel, outwait one hung "
            f"engine, then transfer); raise publication.timeout_s or lower the others"]
