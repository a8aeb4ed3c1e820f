"""Configuration and launch arguments of one SGLang server (the GPU engine backend).

Pinned version: SGLang 0.5.23 (PyPI `sglang==0.5.23`). Every endpoint, payload field and CLI
flag used by `sglang_protocol.py` and `sglang_engine.py` was read from that release's source:
`sglang/srt/entrypoints/http_server.py`, `sglang/srt/managers/io_struct.py`,
`sglang/srt/arg_groups/fields/*.py` and `sglang/api/v1/api_types.py`. A different SGLang
version may rename fields; the `sglang`-marked contract tests catch that.

One engine = one server process = `gpus_per_engine` GPUs (tensor parallel). The server sees
only its own GPUs through CUDA_VISIBLE_DEVICES, so SGLang's `--base-gpu-id` stays 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from rl_async.engine.sglang_routing import FLAG as ROUTED_EXPERTS_FLAG, RoutingLayout
from rl_async.state.collective import NCCL_ENV

SGLANG_VERSION = "0.5.23"  # the SGLang release this backend speaks to (pyproject extra `sglang`)

# Flags this module sets itself; passing them through `server_args` would silently fight them.
_MANAGED_ARGS = {
    "model_path": "model_path",
    "model": "model_path",
    "tp_size": "gpus_per_engine",
    "tensor_parallel_size": "gpus_per_engine",
    "host": "host",
    "port": "port",
    "mem_fraction_static": "mem_fraction_static",
    "max_running_requests": "max_running_requests",
    "weight_version": "initial_weight_version",
    "base_gpu_id": "gpu_ids (the server sees only its own GPUs; base_gpu_id stays 0)",
    "speculative_algorithm": "speculative_algorithm (sglang.speculative_algorithm)",
    "disaggregation_mode": "disaggregation_mode (sglang.disaggregation_mode)",
    "enable_return_routed_experts": "routed_experts (train.routing_replay)",
}


@dataclass(frozen=True)
class SGLangEngineConfig:
    """Settings of one SGLang engine. Picklable: it travels to the engine actor.

    Either `url` (attach to a running server) or `model_path` (launch one) must be set.
    """

    model_path: str = ""
    # Attach to an already running server (e.g. "http://10.0.0.5:30000") instead of launching.
    url: str | None = None
    # GPUs this engine owns (CUDA_VISIBLE_DEVICES); empty = inherit the caller's environment.
    gpu_ids: tuple[int, ...] = ()
    gpus_per_engine: int = 1
    host: str = "127.0.0.1"
    # 0 = pick a free port at launch.
    port: int = 30000
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    # Policy version the server reports at start (`--weight-version`); the controller starts at 0.
    initial_weight_version: int = 0
    # `--speculative-algorithm` (e.g. "EAGLE", "NGRAM"; draft-model flags go in server_args).
    speculative_algorithm: str | None = None
    # `--disaggregation-mode`: "null" (a normal server), "prefill" or "decode".
    disaggregation_mode: str = "null"
    # MoE routing replay (train.routing_replay on, sglang_routing.routing_layout): launch
    # with --enable-return-routed-experts, ask every /generate for the experts and parse
    # them into GenerateOutput.routed_experts. None = off (SGLang then keeps no buffers).
    routed_experts: RoutingLayout | None = None
    # Extra `sglang.launch_server` flags from the run file, e.g. {"dtype": "bfloat16",
    # "disable_radix_cache": True, "cuda_graph_max_bs_decode": 64}. True = bare flag,
    # False/None = omit. SGLang parses its flags strictly: a typo fails the launch.
    server_args: dict[str, Any] = field(default_factory=dict)
    # SGLang's Req.check_finished tests `stop_token_ids` INSIDE `if not ignore_eos`, so
    # ignore_eos = true makes every response run to max_new_tokens past its EOS and stop
    # ids. False (rollouts): stop at the stop ids and at the model's own EOS ids (its
    # tokenizer's and generation config's). True only for fixed-length benchmarks.
    ignore_eos: bool = False
    startup_timeout_s: float = 900.0
    health_poll_interval_s: float = 2.0
    generate_timeout_s: float = 3600.0
    control_timeout_s: float = 120.0
    # init_weights_update_group blocks until the trainer joins; bucket transfers of big models
    # take tens of seconds (LESSONS: 20-60 s for 235B-class models).
    weight_update_timeout_s: float = 1800.0
    # Seconds SGLang may wait for the engine to go idle before refusing a flush (0 = refuse at once).
    flush_timeout_s: float = 0.0
    # Retries of idempotent reads (model info, loads) on connection errors and HTTP 5xx only.
    # State-changing calls and HTTP 4xx are never retried (LESSONS: miles#1497).
    read_retries: int = 2
    retry_backoff_s: float = 1.0
    shutdown_grace_s: float = 30.0
    # How often a running engine polls GET /v1/loads for `load()` (0 = never): one request at
    # a time, each bounded by control_timeout_s, stopped by shutdown().
    load_poll_interval_s: float = 2.0
    # Server log file; None = a file under the system temp directory.
    log_path: str | None = None
    # Interpreter that runs `-m <launch_module>` (sglang.python: SGLang's own virtual env,
    # which pins its own torch and transformers); "" = the current one.
    python_executable: str = ""
    launch_module: str = "sglang.launch_server"

    def __post_init__(self) -> None:
        if self.url is None and not self.model_path:
            raise ValueError(
                "sglang engine: set `model_path` (launch a server) or `url` (attach to one); "
                "both are empty"
            )
        if not isinstance(self.gpus_per_engine, int) or self.gpus_per_engine < 1:
            raise ValueError(
                f"sglang engine: gpus_per_engine = {self.gpus_per_engine!r}: must be an int >= 1"
            )
        if self.gpu_ids and len(self.gpu_ids) != self.gpus_per_engine:
            raise ValueError(
                f"sglang engine: gpu_ids = {list(self.gpu_ids)} has {len(self.gpu_ids)} GPUs but "
                f"gpus_per_engine = {self.gpus_per_engine}: give exactly one id per TP rank"
            )
        if not (0 <= self.port < 65536):
            raise ValueError(f"sglang engine: port = {self.port!r}: must be in [0, 65535]")
        for name in ("startup_timeout_s", "health_poll_interval_s", "generate_timeout_s",
                     "control_timeout_s", "weight_update_timeout_s", "shutdown_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sglang engine: {name} = {getattr(self, name)!r}: must be > 0")
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ValueError(f"sglang engine: disaggregation_mode = {self.disaggregation_mode!r}: "
                             f"must be 'null', 'prefill' or 'decode'")
        if self.load_poll_interval_s < 0:
            raise ValueError(f"sglang engine: load_poll_interval_s = "
                             f"{self.load_poll_interval_s!r}: must be >= 0 (0 = no polling)")
        if self.read_retries < 0 or self.flush_timeout_s < 0 or self.retry_backoff_s < 0:
            raise ValueError(
                "sglang engine: read_retries, flush_timeout_s and retry_backoff_s must be >= 0 "
                f"(got {self.read_retries!r}, {self.flush_timeout_s!r}, {self.retry_backoff_s!r})"
            )
        for key in self.server_args:
            owner = _MANAGED_ARGS.get(_arg_key(key))
            if owner is not None:
                raise ValueError(
                    f"sglang.server_args.{key}: set by the engine itself; use the engine "
                    f"setting `{owner}` instead"
                )


def _arg_key(key: str) -> str:
    return key.lstrip("-").replace("-", "_")


def _flag(key: str) -> str:
    return "--" + _arg_key(key).replace("_", "-")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the server binds it right after; a race is rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def build_server_args(config: SGLangEngineConfig, port: int) -> list[str]:
    """The `sglang.launch_server` argv (without the interpreter) for this engine."""
    argv = [
        "--model-path", config.model_path,
        "--tp-size", str(config.gpus_per_engine),
        "--host", config.host,
        "--port", str(port),
        # Versions travel as strings in SGLang; ours are ints, so "0", "1", ...
        "--weight-version", str(config.initial_weight_version),
    ]
    if config.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(config.mem_fraction_static)]
    if config.max_running_requests is not None:
        argv += ["--max-running-requests", str(config.max_running_requests)]
    if config.speculative_algorithm is not None:
        argv += ["--speculative-algorithm", config.speculative_algorithm]
    if config.disaggregation_mode != "null":
        argv += ["--disaggregation-mode", config.disaggregation_mode]
    if config.routed_experts is not None:
        argv.append(ROUTED_EXPERTS_FLAG)
    for key, value in config.server_args.items():
        argv += _extra_arg(key, value)
    return argv


def _extra_arg(key: str, value: Any) -> list[str]:
    # SGLang's boolean options are store_true flags whose default is off, so False == omitted.
    if value is None or value is False:
        return []
    if value is True:
        return [_flag(key)]
    if isinstance(value, (list, tuple)):
        return [_flag(key), *(str(v) for v in value)]
    if isinstance(value, dict):
        return [_flag(key), json.dumps(value)]
    return [_flag(key), str(value)]


def build_launch_command(config: SGLangEngineConfig, port: int) -> list[str]:
    python = config.python_executable or sys.executable
    return [python, "-m", config.launch_module, *build_server_args(config, port)]


def build_launch_env(config: SGLangEngineConfig, base_env: dict[str, str]) -> dict[str, str]:
    """The server's environment: the caller's, restricted to this engine's GPUs."""
    env = dict(base_env)
    if config.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in config.gpu_ids)
    # Python buffers a piped stdout; unbuffered output keeps the log tail current for errors.
    env["PYTHONUNBUFFERED"] = "1"
    # The NCCL settings the trainer's end of a publication channel runs with (SGLang forces
    # NCCL_CUMEM_ENABLE itself, to the same "0"; set here so the two never differ).
    env.update(NCCL_ENV)
    # SGLang's /health otherwise generates a token, which waits while the engine is paused
    # or a weight update holds its lock, and answers 503 after 20 s (http_server.py
    # health_generate): a long publication would read as dead engines. Liveness instead;
    # SGLang's own watchdog ends a wedged scheduler, and its death ends the server process.
    env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    return env


def signal_group(pid: int, sig: signal.Signals) -> None:
    # The group id is the pid of the server we started (start_new_session=True).
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# Run by the server's own interpreter before SGLang: ask the kernel to SIGKILL this process
# when the engine actor's process dies (however it dies: SIGKILL, OOM), so no server outlives
# its actor holding GPUs, then exec the server. SGLang's schedulers follow it (it kills them
# when their parent goes). Not a preexec_fn: Ray's worker process has threads, and Python
# code between fork and exec can deadlock on a lock another thread held at the fork.
# PR_SET_PDEATHSIG (1) survives execve; a parent already gone is caught by the ppid check.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or sys.exit('rl-async: the engine process that "
    "launched this SGLang server is gone'); "
    "os.execv(sys.argv[2], sys.argv[2:])")


def die_with_parent_command(cmd: list[str], parent_pid: int) -> list[str]:
    """`cmd` (an interpreter and its arguments) run so that it dies with `parent_pid`."""
    return [cmd[0], "-c", _DIE_WITH_PARENT, str(parent_pid), *cmd]
