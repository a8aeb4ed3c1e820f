"""CPU threads per side: the side that bounds the loop gets the cores the other leaves idle.

On CPU, the embedded engines and the trainer workers share the cores Ray reserved for them
(`cluster.engine_cpus` x `cluster.cpu_engines` + `cluster.trainer_cpus` x
`cluster.trainer_workers`). Each process starts with its reservation as torch intra-op threads
(`initial_split`, printed by `rl-async plan`). With `cluster.cpu_threads = "auto"` the
controller then measures the cores each side keeps busy (process CPU seconds over wall
seconds, the side's processes summed) and runs one trial:

    measuring --window--> trial: the bound side gets the idle cores --window--> settled
        |                          kept when updates got >= 5% faster, reverted otherwise
        +-- no side bounds the loop: settled as planned

A side bounds the loop when it keeps >= 3/4 of its threads busy while the other leaves at
least a quarter of a core idle. The bound side's threads grow to the cores minus what the
other side was measured to use, plus 3/4 of a core of slack, rounded down: the other side
keeps its threads, busy part of the time, so the machine may be oversubscribed by up to that
slack, and the trial decides whether it pays. Measured on SmolLM2 (benchmarks/vs_trl.py,
filter off): the engine used 0.52 of its core, the trainer got 2 threads, 5.88 -> 4.64 s per
update; with the zero-variance filter the engine regenerates and uses 0.9 of its core, and
the plan's split stays.

A window is whole collections, at least `min_updates` optimizer updates and `min_seconds` of
loop time; a collection with an evaluation or a checkpoint beside it is left out (`interrupt`:
an evaluation's generation would count as the engine's load). One trial per run: the decision
is measured, logged (`threads/*`, the summary's `threads`) and not revisited, so a noisy
window cannot make the split oscillate. Pure: the fleet applies a split (`set_threads` on its
actors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BUSY = 0.75          # a side using this share of its threads is saturated
IDLE_CORES = 0.25    # ... while the other leaves this many cores idle
SLACK = 0.75         # cores of oversubscription tolerated when lending (the trial reverts
                     # a split that contention makes slower)
KEEP_IF_FASTER = 0.95  # a trial is kept when seconds per update drop below 95%


@dataclass(frozen=True)
class Split:
    engine: int   # torch threads per engine process
    trainer: int  # torch threads per trainer worker


@dataclass(frozen=True)
class Usage:
    """Cumulative counters, as the actors report them."""
    engine_cpu_s: float   # process CPU seconds, all engines summed
    trainer_cpu_s: float  # process CPU seconds, all trainer workers summed
    loop_s: float         # the controller's loop seconds (collection, training, publication)
    updates: int          # optimizer updates so far
    wall_s: float         # monotonic wall clock
    # each live engine's own counter: one engine's restart (its counter starts again) hides
    # in the sum while the others' grow
    per_engine: tuple[tuple[str, float], ...] = ()

    def totals(self) -> tuple[float, float, float, float, float]:
        return self.engine_cpu_s, self.trainer_cpu_s, self.loop_s, self.updates, self.wall_s

    def restarted_since(self, last: Usage) -> bool:
        """A process started again between the two: a counter fell, or the engines changed
        (one went down or came back), so the increments are not usage."""
        before = dict(last.per_engine)
        return (self.trainer_cpu_s < last.trainer_cpu_s or self.engine_cpu_s < last.engine_cpu_s
                or set(before) != {k for k, _ in self.per_engine}
                or any(v < before[k] for k, v in self.per_engine))


def initial_split(cfg) -> Split:
    """The plan's split: engine.torch_threads per engine, each trainer worker its reserved
    cores (cluster.trainer_cpus)."""
    return Split(engine=cfg.engine.torch_threads, trainer=max(1, int(cfg.cluster.trainer_cpus)))


def balances(cfg) -> bool:
    """Whether the run balances threads: auto, embedded engines and trainers on CPU, and not
    run.deterministic (a thread count changes how reductions split, so the bits)."""
    c = cfg.cluster
    return (c.cpu_threads == "auto" and cfg.engine.backend == "embedded"
            and not c.inference_gpus and not c.trainer_gpus and not cfg.run.deterministic)


def balancer_for(cfg) -> ThreadBalancer | None:
    if not balances(cfg):
        return None
    c = cfg.cluster
    return ThreadBalancer(c.engine_cpus * c.cpu_engines + c.trainer_cpus * c.trainer_workers,
                          c.cpu_engines, c.trainer_workers, initial_split(cfg))


def describe(cfg) -> str:
    """The plan's line on threads."""
    split, c = initial_split(cfg), cfg.cluster
    if cfg.engine.backend != "embedded" or c.inference_gpus or c.trainer_gpus:
        return "torch threads: not set here (GPU or non-embedded engines)"
    text = (f"torch threads: {split.engine} per engine x {c.cpu_engines}, {split.trainer} per "
            f"trainer worker x {c.trainer_workers}")
    if balances(cfg):
        return text + (" (cluster.cpu_threads = auto: after a measured window, the side that "
                       "bounds the loop gets the cores the other leaves idle)")
    why = "run.deterministic" if cfg.run.deterministic else "cluster.cpu_threads = fixed"
    return text + f" ({why}: kept for the whole run)"


class ThreadBalancer:
    def __init__(self, cores: float, engines: int, trainers: int, start: Split,
                 min_updates: int = 3, min_seconds: float = 5.0):
        self.cores, self.engines, self.trainers = cores, engines, trainers
        self.split = self.planned = start
        self.min_updates, self.min_seconds = min_updates, min_seconds
        self.state = "measuring"  # -> "trial" -> "settled"
        self.bound = "unknown"    # "trainer" | "engine" | "both" | "neither"
        self.decision = ""
        self.engine_cores = self.trainer_cores = 0.0  # last window's measured use
        self._last: Usage | None = None
        self._dirty = False
        self._window = [0.0] * 5  # the window's sums of Usage's fields, in their order
        self._before_s_per_update = 0.0

    def interrupt(self) -> None:
        """Something outside the loop runs now (an evaluation, a checkpoint): the usage up to
        the next collection is not the loop's, so that one increment is left out."""
        self._dirty = True

    def observe(self, usage: Usage) -> Split | None:
        """After every collection: a split to apply now, or None."""
        if self.state == "settled":
            return None
        last, self._last = self._last, usage
        if last is None or self._dirty or usage.restarted_since(last):
            self._dirty = False
            return None
        self._window = [w + now - then for w, now, then
                        in zip(self._window, usage.totals(), last.totals())]
        engine_s, trainer_s, loop_s, updates, wall = self._window
        if updates < self.min_updates or loop_s < self.min_seconds or wall <= 0:
            return None
        self._window = [0.0] * 5
        self.engine_cores, self.trainer_cores = engine_s / wall, trainer_s / wall
        per_update = loop_s / updates
        if self.state == "measuring":
            return self._propose(per_update)
        return self._judge(per_update)

    def _propose(self, per_update: float) -> Split | None:
        e_threads, t_threads = self.split.engine * self.engines, self.split.trainer * self.trainers
        engine_busy = self.engine_cores >= BUSY * e_threads
        trainer_busy = self.trainer_cores >= BUSY * t_threads
        self.bound = ("both" if engine_busy and trainer_busy else "trainer" if trainer_busy
                      else "engine" if engine_busy else "neither")
        proposal = self.split
        if self.bound == "trainer" and e_threads - self.engine_cores >= IDLE_CORES:
            grow = math.floor((self.cores + SLACK - self.engine_cores) / self.trainers)
            proposal = Split(self.split.engine, max(self.split.trainer, grow))
        elif self.bound == "engine" and t_threads - self.trainer_cores >= IDLE_CORES:
            grow = math.floor((self.cores + SLACK - self.trainer_cores) / self.engines)
            proposal = Split(max(self.split.engine, grow), self.split.trainer)
        if proposal == self.split:
            self.state = "settled"
            why = {"both": "both sides are busy (the machine is full)",
                   "neither": "neither side keeps its threads busy (the loop waits on "
                              "something else)"}.get(self.bound, f"the {self.bound} side "
                                                                 "bounds, no core is idle")
            self.decision = f"kept the plan's split: {why} ({self._usage_text()})"
            return None
        self.state = "trial"
        self._before_s_per_update = per_update
        self.split = proposal
        return proposal

    def _judge(self, per_update: float) -> Split | None:
        before = self._before_s_per_update
        self.state = "settled"
        if per_update <= KEEP_IF_FASTER * before:
            self.decision = (f"the {self.bound} side bounds the loop: gave it the idle cores "
                             f"(engine {self.split.engine}, trainer {self.split.trainer} "
                             f"threads): {before:.3g} -> {per_update:.3g} s per update")
            return None
        self.decision = (f"the {self.bound} side bounds the loop, but more threads did not "
                         f"make it faster ({before:.3g} -> {per_update:.3g} s per update): "
                         f"back to engine {self.planned.engine}, trainer "
                         f"{self.planned.trainer}")
        self.split = self.planned
        return self.planned

    def _usage_text(self) -> str:
        return (f"engines use {self.engine_cores:.2f} of {self.split.engine * self.engines} "
                f"threads, trainers {self.trainer_cores:.2f} of "
                f"{self.split.trainer * self.trainers}")

    def metrics(self) -> dict[str, float]:
        return {"threads/engine": float(self.split.engine),
                "threads/trainer": float(self.split.trainer),
                "threads/engine_cores_used": self.engine_cores,
                "threads/trainer_cores_used": self.trainer_cores}

    def summary(self) -> dict:
        return {"engine": self.split.engine, "trainer": self.split.trainer,
                "planned": {"engine": self.planned.engine, "trainer": self.planned.trainer},
                "bound": self.bound, "state": self.state, "decision": self.decision,
                "engine_cores_used": round(self.engine_cores, 3),
                "trainer_cores_used": round(self.trainer_cores, 3)}


def usage_from(metrics: dict[str, float], trainer_workers: int, loop_s: float, updates: int,
               now: float) -> Usage:
    """A collection's gathered metrics -> cumulative usage. Engines report their own
    `engine/<i>/cpu_seconds`; the trainer's come from the reporting rank's train metrics,
    times the workers (data-parallel ranks do the same work)."""
    per_engine = tuple(sorted((k, v) for k, v in metrics.items()
                              if k.startswith("engine/") and k.endswith("/cpu_seconds")))
    return Usage(engine_cpu_s=sum(v for _, v in per_engine),
                 trainer_cpu_s=metrics.get("trainer/cpu_seconds", 0.0) * trainer_workers,
                 loop_s=loop_s, updates=updates, wall_s=now, per_engine=per_engine)
