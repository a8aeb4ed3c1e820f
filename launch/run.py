"""`rl-async run`: the driver. Starts (or joins) Ray, launches the controller actor, shows a
live progress line, handles a graceful stop and writes the summary.

Locally it starts a single-node cluster bound to 127.0.0.1; with RAY_ADDRESS set (as under
`ray job submit`) it joins that cluster. SIGTERM (`ray job stop`) and Ctrl-C ask the
controller to stop gracefully: finish the current collection, drain, evaluate, summarise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from rl_async.plan.checks import Report
from rl_async.plan.config import RunConfig

POLL_S = 1.0


def _init_ray(cfg: RunConfig, dashboard: bool = False) -> bool:
    """Returns True when this driver started the cluster (and so must stop it). A local
    cluster has the Ray dashboard only when asked (`rl-async run --dashboard`): it costs
    start-up time and memory that a small machine's run would rather have."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                "TOKENIZERS_PARALLELISM": "false"}}
    if os.environ.get("RAY_ADDRESS"):
        # log_to_driver: actor errors and tracebacks reach this output, and `ray job logs`
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env,
                 log_to_driver=True)
        return False
    c = cfg.cluster
    cpus = max(os.cpu_count() or 2,
               int(c.engine_cpus * max(1, c.cpu_engines) + c.trainer_cpus * c.trainer_workers))
    context = ray.init(num_cpus=cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
                       log_to_driver=True, runtime_env=runtime_env,
                       _node_ip_address="127.0.0.1")
    if dashboard:
        print(f"[rl-async] Ray dashboard: http://{context.dashboard_url}", flush=True)
    return True


# The controller actor's name lives here, not in the driver's own (anonymous) namespace, so
# `rl-async scale` and other drivers on the cluster find it.
CONTROL_NAMESPACE = "rl-async"


def controller_options(run_name: str) -> dict:
    """Where a run's controller actor is registered: `<run.name>/controller`."""
    return {"name": f"{run_name}/controller", "namespace": CONTROL_NAMESPACE}


def _print_plan(cfg: RunConfig, report: Report) -> None:
    p = report.plan
    print(f"[rl-async] {cfg.run.name}: {p.engines} engine(s), producer {p.producer_samples} samples "
          f"({p.producer_groups} groups, {p.submission_granularity}), HTTP slots {p.http_slots}, "
          f"engine slots {p.engine_slots}, buffer {p.completed_buffer_groups} groups, lag "
          f"{p.max_weight_staleness}, {p.optimizer_steps_per_collection} update(s)/collection, "
          f"{'fully async' if cfg.fully_async else 'synchronous'}", flush=True)
    for w in report.warnings:
        print(f"[rl-async] warning {w.code}: {w.message}", flush=True)
    _note_job_stop_window()


# `ray job stop` sends SIGTERM, then SIGKILL after this many seconds (Ray 2.60's default: 3),
# read by the job's supervisor actor, whose environment includes the job's runtime_env vars.
JOB_STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"
RAY_DEFAULT_JOB_STOP_WAIT_S = 3


def _note_job_stop_window() -> None:
    """Under `ray job submit`, say how long a `ray job stop` leaves for the graceful drain."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:  # set by Ray's job supervisor only
        return
    window = os.environ.get(JOB_STOP_WAIT_ENV)
    if window is None:
        print(f"[rl-async] note: `ray job stop` SIGKILLs this driver {RAY_DEFAULT_JOB_STOP_WAIT_S}"
              f" s after its SIGTERM, usually before the graceful drain, final eval and summary"
              f" finish; submit with --runtime-env-json "
              f"'{{\"env_vars\": {{\"{JOB_STOP_WAIT_ENV}\": \"300\"}}}}' to allow 300 s",
              flush=True)
    else:
        print(f"[rl-async] `ray job stop` allows {window} s for the graceful drain "
              f"({JOB_STOP_WAIT_ENV})", flush=True)


def _progress_line(p: dict) -> str:
    if "step" not in p:
        return f"[rl-async] {p.get('phase', 'starting')} ..."
    return (f"[rl-async] {p['phase']:<8} step {p['step']}/{p['max_steps']} v{p['version']} "
            f"reward {p['reward']:.3f} staleness {p['staleness']:.2f} "
            f"trainer wait {p['trainer_wait_seconds']:.1f}s "
            f"discard {p['discard_fraction']:.3f}"
            + (f" bound: {p['bound']}" if p.get("bound") else ""))


def resolve_resume(cfg: RunConfig, resume: str | None):
    """`--resume [PATH]` -> (config, run directory, Resume), or (config, None, None) for a
    fresh run. Refuses config changes the checkpoint cannot survive, naming the key; keeps
    the lr schedule's horizon the run started with when run.max_steps changes."""
    if resume is None:
        return cfg, None, None
    from actors.fleet import Resume
    from rl_async.state import checkpoints as ckpts
    path = ckpts.find_checkpoint(cfg.run.output_dir, cfg.run.name,
                                 None if resume == LATEST else resume)
    meta = ckpts.load_meta(path)
    changes = ckpts.incompatible_changes(meta["config"], cfg.to_dict())
    if changes:
        raise ckpts.ResumeError(f"cannot resume {path}: " + "; ".join(changes))
    print(f"[rl-async] resuming from {path} (step {meta['step']}, policy version "
          f"{meta['policy_version']})", flush=True)
    cfg = ckpts.keep_schedule_horizon(meta["config"], cfg)
    return cfg, str(path.parent), Resume(str(path), int(meta["step"]),
                                         int(meta["policy_version"]), meta["ledger"],
                                         meta["config"], meta.get("prompt_stream"),
                                         meta.get("progress", {}))


LATEST = "latest"  # `--resume` without a path


def _warn_shared_storage(cfg: RunConfig) -> None:
    """Checkpoints are written by the ranks that hold the data, on whatever node they run:
    with several nodes, run.output_dir must be storage they all share."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    out = cfg.run.output_dir
    if len(nodes) > 1 and (not os.path.isabs(out) or out.startswith("/tmp")):
        print(f"[rl-async] warning: run.output_dir = {out!r} on a {len(nodes)}-node cluster: "
              f"checkpoints and exports need shared storage (an absolute path every node "
              f"mounts); a relative path under `ray job submit` lands in the job's temporary "
              f"working dir and is lost", flush=True)


def run_training(cfg: RunConfig, report: Report, summary_json: str | None,
                 resume: str | None = None, dashboard: bool = False) -> int:
    _print_plan(cfg, report)
    cfg, run_dir, resume_from = resolve_resume(cfg, resume)
    started = _init_ray(cfg, dashboard)
    import ray

    from actors.controller import ControllerActor

    _warn_shared_storage(cfg)
    controller = ControllerActor.options(**controller_options(cfg.run.name)).remote(
        cfg, report.plan, [w.to_dict() for w in report.warnings], run_dir, resume_from)
    run_ref = controller.run.remote()

    stop_signal: list[int] = []

    def graceful(signum, _frame):
        # Only record it: the poll loop below prints and sends the request (no I/O or Ray
        # calls inside a signal handler), and re-sends it each poll because a controller
        # still building its fleet has nothing to stop yet and ignores the request.
        stop_signal.append(signum)

    old = {s: signal.signal(s, graceful) for s in (signal.SIGTERM, signal.SIGINT)}
    tty = sys.stdout.isatty()
    last_progress: dict = {}
    last_line, last_print, announced = "", 0.0, False
    try:
        while True:
            if stop_signal:
                if not announced:
                    print(f"\n[rl-async] signal {stop_signal[0]}: stopping gracefully "
                          f"(drain, eval, summary)", flush=True)
                    announced = True
                controller.request_stop.remote()
            ready, _ = ray.wait([run_ref], timeout=POLL_S)
            if ready:
                break
            try:
                last_progress = ray.get(controller.progress.remote(), timeout=30)
            except Exception:  # noqa: BLE001 -- a dead controller: run_ref says why next poll
                continue
            line = _progress_line(last_progress)
            if tty:
                print("\r" + line.ljust(110), end="", flush=True)
            elif line != last_line and time.monotonic() - last_print > 5:
                print(line, flush=True)
                last_line, last_print = line, time.monotonic()
        if tty:
            print()
        try:
            summary = ray.get(run_ref)
            code = 0
        except Exception as exc:  # the run failed: report the cause, keep the ledger
            try:
                summary = ray.get(controller.failure_summary.remote(), timeout=60) or {}
            except Exception as lost:  # noqa: BLE001 -- the controller itself died
                summary = {"steps": last_progress.get("step"),
                           "policy_version": last_progress.get("version"),
                           "controller": f"unreachable: {type(lost).__name__}",
                           "last_progress": last_progress}
            summary["error"] = _cause(exc)
            code = 1
            print(f"[rl-async] run failed: {summary['error']}", file=sys.stderr, flush=True)
        _write_summary(summary, summary_json)
        return code
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if started:
            ray.shutdown()


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _cause(exc: BaseException) -> str:
    """The innermost exception's type and message (a nested Ray task error's own text is a
    traceback whose cause comes last), the Ray tasks it travelled through, no ANSI colour
    codes; a long message keeps its start (where the component is named) and its end."""
    chain = [exc]
    while getattr(chain[-1], "cause", None) is not None and chain[-1].cause is not chain[-1]:
        chain.append(chain[-1].cause)
    inner = chain[-1]
    where = [str(e.function_name) for e in chain if getattr(e, "function_name", None)]
    text = _ANSI.sub("", f"{type(inner).__name__}: {inner}".strip())
    if where:  # innermost first: where it was raised, then the tasks it came through
        text += f" (raised in {', via '.join(reversed(where))})"
    return text if len(text) <= 4000 else f"{text[:2500]} ... {text[-1400:]}"


SUMMARY_FILE = "summary.json"


def _write_summary(summary: dict, path: str | None) -> None:
    """Print the summary, and write it to `<run dir>/summary.json` (every run, so `rl-async
    compare` and `simulate --calibrate` always have it) and to `--summary-json PATH`. The
    run directory is on the controller's node: with several nodes it is the shared
    run.output_dir, otherwise it may not exist here, and then only PATH is written."""
    text = json.dumps(summary, indent=2, default=str)
    print("[rl-async] summary:\n" + text, flush=True)
    targets = [Path(path)] if path else []
    run_dir = summary.get("run_dir")
    if run_dir and Path(run_dir).is_dir():
        targets.append(Path(run_dir) / SUMMARY_FILE)
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
    if run_dir and Path(run_dir).is_dir():
        print(f"[rl-async] summary written to {Path(run_dir) / SUMMARY_FILE}", flush=True)
