"""`rl-async doctor FILE`: can this machine start the run file's backends?

One table: the installed versions of the packages a GPU run rests on, `pip check`, the
visible GPUs, then one row per thing the run file needs, each ok, a warning, or a BLOCKER
naming the key and the fix. Exit 2 when anything is a blocker, 0 otherwise.

Each interpreter is probed in a child process (importing SGLang or Transformer Engine into
the CLI itself is slow and not needed): the run's own, and `sglang.python` when set (SGLang
0.5.23 pins torch 2.14.1 and transformers 5.19.0, so it usually has a virtual env of its
own). Run it on a node of the cluster: the GPU rows describe the machine it runs on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field

from rl_async.plan.config import RunConfig

PACKAGES = ("torch", "transformers", "sglang", "megatron-core", "transformer-engine")
PINNED = {"sglang": "0.5.23", "megatron-core": "0.16.1"}  # what rl-async's code was read against
PROBE_TIMEOUT_S = 300

# Run by each probed interpreter; prints one JSON object. Standard library and torch only,
# then one guarded import per optional package.
_PROBE = r"""
import importlib, importlib.metadata as md, json, subprocess, sys
out = {"python": sys.executable, "versions": {}, "imports": {}, "gpus": [], "nccl": False}
for name in ("torch", "transformers", "sglang", "megatron-core", "transformer-engine",
             "transformer_engine", "math-verify"):
    try:
        out["versions"][name] = md.version(name)
    except md.PackageNotFoundError:
        pass
try:
    import torch
    out["cuda_build"] = torch.version.cuda
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    out["nccl"] = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available())
except Exception as exc:
    out["imports"]["torch"] = f"{type(exc).__name__}: {exc}"
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
        out["imports"][module] = None
    except Exception as exc:
        out["imports"][module] = f"{type(exc).__name__}: {str(exc)[:300]}"
check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
out["pip_check"] = [check.returncode, (check.stdout + check.stderr).strip()[:2000]]
print(json.dumps(out))
"""
MODULES = ("sglang", "megatron.core", "transformer_engine.pytorch", "math_verify")


@dataclass
class Probe:
    python: str
    versions: dict[str, str] = field(default_factory=dict)
    imports: dict[str, str | None] = field(default_factory=dict)  # module -> error or None
    gpus: list[str] = field(default_factory=list)
    nccl: bool = False
    cuda_build: str | None = None
    pip_check: tuple[int, str] = (0, "")
    error: str = ""  # the interpreter could not be probed at all

    def importable(self, module: str) -> bool:
        return not self.error and module in self.imports and self.imports[module] is None

    def version(self, package: str) -> str | None:
        return self.versions.get(package) or (self.versions.get("transformer_engine")
                                               if package == "transformer-engine" else None)


@dataclass
class Row:
    what: str
    status: str  # "ok", "warn", "BLOCKER", "info"
    detail: str


def probe(python: str) -> Probe:
    try:
        done = subprocess.run([python, "-c", _PROBE, *MODULES], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Probe(python, error=f"{type(exc).__name__}: {exc}")
    if done.returncode != 0:
        return Probe(python, error=f"exit {done.returncode}: {done.stderr.strip()[-500:]}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return Probe(python=python, versions=data["versions"], imports=data["imports"],
                 gpus=data["gpus"], nccl=data["nccl"], cuda_build=data.get("cuda_build"),
                 pip_check=tuple(data["pip_check"]))


def environment_rows(here: Probe, sglang_env: Probe | None) -> list[Row]:
    rows = []
    for env, label in ((here, "run"), (sglang_env, "sglang.python")):
        if env is None:
            continue
        if env.error:
            rows.append(Row(f"{label} interpreter", "BLOCKER", f"{env.python}: {env.error}"))
            continue
        versions = ", ".join(f"{p} {env.version(p) or '-'}" for p in PACKAGES)
        rows.append(Row(f"{label}: versions", "info", f"{env.python}: {versions}"))
        code, text = env.pip_check
        rows.append(Row(f"{label}: pip check", "ok" if code == 0 else "warn",
                        "no broken requirements" if code == 0 else text.replace("\n", "; ")))
        rows.append(Row(f"{label}: GPUs", "info", (f"{len(env.gpus)}: {', '.join(env.gpus)}"
                                                   if env.gpus else
                                                   f"none visible (torch CUDA build: "
                                                   f"{env.cuda_build or 'none, a CPU wheel'})")))
    return rows


def _need(rows: list[Row], ok: bool, what: str, missing: str, fine: str = "yes") -> None:
    rows.append(Row(what, "ok" if ok else "BLOCKER", fine if ok else missing))


def _pinned(rows: list[Row], env: Probe, module: str, package: str, what: str,
            missing: str) -> None:
    """A package the run needs: importable (else a blocker), at the version rl-async was
    written against (else a warning)."""
    _need(rows, env.importable(module), what,
          f"{missing} ({env.imports.get(module) or env.error})")
    got = env.version(package)
    if got and got != PINNED[package]:
        rows.append(Row(f"{package} version", "warn", f"{got}: rl-async is written against "
                        f"{package} {PINNED[package]}; other versions may differ"))


def requirement_rows(cfg: RunConfig, here: Probe, sglang_env: Probe | None) -> list[Row]:
    """What the run file needs of this machine's interpreters."""
    c, rows = cfg.cluster, []
    if c.trainer_gpus:
        _need(rows, bool(here.gpus), "trainers on GPU",
              f"cluster.trainer_gpus = {c.trainer_gpus} but {here.python} sees no CUDA GPU")
        _need(rows, here.nccl, "NCCL for the trainers and publication",
              f"cluster.trainer_gpus = {c.trainer_gpus} needs torch with NCCL "
              f"(torch.distributed.is_nccl_available() is false in {here.python})")
    if cfg.engine.backend == "sglang":
        rows += _sglang_rows(cfg, here, sglang_env)
    elif c.inference_gpus:
        _need(rows, bool(here.gpus), "engines on GPU",
              f"cluster.inference_gpus = {c.inference_gpus} but {here.python} sees no GPU")
    if cfg.train.backend == "megatron":
        rows += _megatron_rows(cfg, here)
    if cfg.task.name == "math":
        _need(rows, here.importable("math_verify"), "math-verify (task.name = 'math')",
              f"task.name = 'math' grades with math-verify: pip install -e '.[math]' "
              f"({here.imports.get('math_verify')})")
    return rows


def _sglang_rows(cfg: RunConfig, here: Probe, sglang_env: Probe | None) -> list[Row]:
    env = sglang_env or here
    where = (f"sglang.python = {cfg.sglang.python!r}" if cfg.sglang.python
             else f"sglang.python unset (the run's own {here.python})")
    rows: list[Row] = []
    _pinned(rows, env, "sglang", "sglang", "SGLang importable by the engines",
            f"engine.backend = 'sglang' needs sglang=={PINNED['sglang']} importable by "
            f"{where}; install it in a virtual env of its own (it pins torch 2.14.1) and set "
            f"sglang.python to its interpreter")
    if cfg.cluster.inference_gpus:
        _need(rows, bool(env.gpus), "engines on GPU",
              f"cluster.inference_gpus = {cfg.cluster.inference_gpus} but {env.python} sees "
              f"no CUDA GPU (SGLang needs one per TP rank)")
    if not cfg.sglang.python and env.importable("sglang"):
        rows.append(Row("one interpreter for SGLang and the trainers", "warn",
                        f"SGLang pins torch {env.version('torch')}: the trainers (megatron-core, "
                        f"Transformer Engine) must work on it too; a separate sglang.python "
                        f"keeps the two stacks apart"))
    return rows


def _megatron_rows(cfg: RunConfig, here: Probe) -> list[Row]:
    rows: list[Row] = []
    _pinned(rows, here, "megatron.core", "megatron-core",
            "megatron-core (train.backend = 'megatron')",
            f"train.backend = 'megatron' needs megatron-core=={PINNED['megatron-core']}: "
            f"pip install -e '.[megatron]'")
    impl = cfg.train.transformer_impl
    wants_te = impl == "transformer_engine" or (impl == "auto" and cfg.cluster.trainer_gpus)
    if wants_te:
        have = here.importable("transformer_engine.pytorch") and bool(here.gpus)
        why = here.imports.get("transformer_engine.pytorch") or "no CUDA GPU"
        if impl == "transformer_engine":
            _need(rows, have, "Transformer Engine (train.transformer_impl)",
                  f"train.transformer_impl = 'transformer_engine' needs Transformer Engine "
                  f"built for torch {here.version('torch')} on a GPU: {why}")
        elif not have:
            rows.append(Row("Transformer Engine (train.transformer_impl = 'auto')", "warn",
                            f"not usable ({why}): megatron falls back to local attention, "
                            f"whose s x s scores the memory plan did not count"))
    return rows


def doctor(cfg: RunConfig) -> tuple[list[Row], bool]:
    """(rows, whether anything blocks the run)."""
    here = probe(sys.executable)
    other = probe(cfg.sglang.python) if (cfg.sglang.python
                                         and cfg.engine.backend == "sglang") else None
    rows = environment_rows(here, other) + requirement_rows(cfg, here, other)
    return rows, any(r.status == "BLOCKER" for r in rows)


def print_rows(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rl-async doctor", show_lines=False)
    for name in ("check", "status", "detail"):
        table.add_column(name, overflow="fold")
    colors = {"ok": "green", "warn": "yellow", "BLOCKER": "bold red", "info": ""}
    for row in rows:
        table.add_row(row.what, f"[{colors[row.status]}]{row.status}" if colors[row.status]
                      else row.status, row.detail)
    Console(width=160).print(table)
