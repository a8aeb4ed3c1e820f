"""Ray metrics sink: key figures as `ray.util.metrics` gauges, so they appear in the Ray
dashboard's metrics view and in Prometheus (names use underscores: Prometheus rules; Ray
adds the prefix `ray_`, so Prometheus and the Grafana dashboard in dashboards/ show
`ray_rl_async_*`)."""

from __future__ import annotations

from ray.util.metrics import Gauge

# W&B name -> (Prometheus name, description)
EXPORTED = {
    "rollout/fully_async/queue_size": ("rl_async_buffer_occupancy_groups",
                                       "completed groups waiting in the buffer"),
    "producer/samples_in_flight": ("rl_async_in_flight_samples",
                                   "samples being generated right now"),
    "rollout/fully_async/avg_staleness": ("rl_async_staleness_avg",
                                          "mean age of delivered groups (optimizer updates)"),
    "rollout/fully_async/max_staleness": ("rl_async_staleness_max",
                                          "max age of delivered groups (optimizer updates)"),
    "rollout/fully_async/completed_queue/dropped_samples_fraction": (
        "rl_async_discard_fraction", "share of completed samples discarded as stale"),
    "train/trainer_wait_seconds": ("rl_async_trainer_wait_seconds",
                                   "seconds the trainer waited for the last collection"),
    "publish/publication_seconds": ("rl_async_publication_seconds",
                                    "seconds the last weight publication took"),
    "perf/useful_tokens_per_s": ("rl_async_useful_tokens_per_second",
                                 "delivered response tokens per wall second"),
    "policy/version": ("rl_async_policy_version", "current policy version"),
    "rollout/reward_mean": ("rl_async_reward_mean", "mean reward of the last collection"),
    "perf/trainer_wait_fraction": ("rl_async_trainer_wait_fraction",
                                   "share of the run's wall time the trainer waited"),
    "faults/engine_restarts": ("rl_async_faults_engine_restarts",
                               "engines restarted so far (engine.max_restarts bounds it)"),
    "faults/engines_down": ("rl_async_faults_engines_down",
                            "engines out of routing right now (dead, hung or restarting)"),
    "faults/retried_requests": ("rl_async_faults_retried_requests",
                                "requests aborted by a transient engine failure, regenerated"),
    "faults/failed_groups": ("rl_async_faults_failed_groups",
                             "groups failed with an error (reward, bad request) so far"),
    "reward/retries": ("rl_async_faults_reward_retries",
                       "reward / judge calls retried so far"),
}
# Prometheus shows every gauge above with Ray's prefix: `ray_rl_async_...`
PROMETHEUS_PREFIX = "ray_"


class RayMetricsSink:
    def __init__(self) -> None:
        self.gauges = {name: Gauge(prom, description=desc) for name, (prom, desc) in EXPORTED.items()}

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, gauge in self.gauges.items():
            if name in metrics:
                gauge.set(metrics[name])

    def close(self) -> None:
        pass
