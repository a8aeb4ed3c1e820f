"""Every number the simulation takes from outside the core, and where each came from
(rl_async.sim.calibrate builds it from `[synthetic]` or a run's calibration)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_async.engine.timing import EngineTiming, ResponseLengths, TrainerTiming, TransferTiming


@dataclass(frozen=True)
class TurnTiming:
    """Multi-turn trajectories (SPEC §12), from a calibration: assistant turns per trajectory
    (a fractional mean draws floor or ceil), the environment's tokens between two turns and
    its seconds after each turn (step, and reset/score spread over the turns)."""

    turns_mean: float
    env_tokens_per_gap: float
    env_seconds_per_turn: float


@dataclass(frozen=True)
class SimTimings:
    """Every number the simulation takes from outside the core, and where each came from."""

    engine: EngineTiming
    lengths: ResponseLengths
    transfer: TransferTiming
    trainer: TrainerTiming
    publish_bytes: int
    prompt_tokens: int
    # The controller loop's own time per optimizer step (0 unless calibrated: actor calls).
    controller_seconds_per_step: float = 0.0
    # A publication's control round trips (continue, resume) beyond drain and transfer,
    # the trainer's snapshot, and one control call's round trip (stop submissions, pause,
    # the buffer's new version): 0 unless calibrated.
    publication_overhead_s: float = 0.0
    snapshot_s: float = 0.0
    control_call_s: float = 0.0
    # Moving a collection from the buffer to the controller (0 unless calibrated).
    collection_transport_s: float = 0.0
    # Gathering every actor's metrics, beside the publication (0 unless calibrated).
    metrics_gather_s: float = 0.0
    # A real evaluation's measured seconds: an evaluation lasts at least this long (its
    # actor calls, reward scoring and metrics are not simulated; 0 unless calibrated).
    eval_seconds: float = 0.0
    # A generate call's round trip outside the engine (producer latency minus the engine's
    # own; 0 unless calibrated): it decides whether a fed engine idles between requests.
    request_transit_s: float = 0.0
    # The producer's prompt fetch and reward call (actor round trips; 0 unless calibrated).
    fetch_latency_s: float = 0.0
    score_latency_s: float = 0.0
    # Multi-turn: None simulates one generate call per sample.
    turns: TurnTiming | None = None
    sources: dict[str, str] = field(default_factory=dict)
