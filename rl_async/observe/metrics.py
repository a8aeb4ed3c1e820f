"""One place that logs metrics: a logger fanning out to sinks (W&B, console, Ray metrics).

Actors return plain `{name: float}` dicts; the controller merges them per step and calls
`MetricsLogger.log` once. A sink that fails to log raises: metrics are part of the product.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any, Protocol


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class MetricsLogger:
    def __init__(self, sinks: list[Sink] | None = None):
        self.sinks = list(sinks or [])
        self.last: dict[str, float] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        # NaN and inf are logged as they are: a diverging run must show it, not a gap.
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self.last.update(clean)
        for sink in self.sinks:
            sink.log(clean, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class WandbSink:
    """W&B run with the resolved config and capacity plan as its config. Offline by default
    locally (files under `<output_dir>/wandb`), online when `wandb.mode = "online"`."""

    def __init__(self, mode: str, project: str, entity: str | None, name: str,
                 config: dict[str, Any], directory: str | Path):
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(mode=mode, project=project, entity=entity, name=name,
                              config=config, dir=str(directory), reinit="finish_previous")
        self.dir = self.run.dir

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MemorySink:
    """Keeps the last `keep` logged rows (the controller's recent history, tests): bounded,
    so a long run's controller does not grow with every row it ever logged."""

    def __init__(self, keep: int = 1000) -> None:
        self.rows: deque[tuple[int, dict[str, float]]] = deque(maxlen=keep)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def close(self) -> None:
        pass
