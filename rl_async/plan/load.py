"""Loading a run file: TOML -> `--set` overrides -> profile defaults -> aliases -> RunConfig.

Precedence, lowest first: section defaults, profile defaults, the file, `--set`. A profile
default fills a key only when neither the file nor `--set` gave it, so "explicit" always
means "the user wrote it" (the alias rules of SPEC §2 depend on that).

Structured vs low-level (SPEC §2): a file with an `[async]` table is structured; a file
without one that sets `[core]` or `[miles]` is low-level and keeps the native defaults
(synchronous, zero lag, one wave of HTTP permits, one collection of producer budget). A file
with none of these tables is treated as structured, so profiles apply as documented.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rl_async.plan.config import RunConfig

LAG_ALIASES = ("async.max_weight_staleness", "core.max_policy_lag", "miles.max_weight_staleness")
STRUCTURED_LAG_DEFAULT = 6

# Profiles set defaults, not cluster sizes (SPEC §2).
PROFILE_DEFAULTS: dict[str, dict[str, Any]] = {
    "local": {"engine.backend": "embedded", "wandb.mode": "offline", "async.fully_async": True},
    "dev": {"engine.backend": "embedded", "wandb.mode": "offline", "async.fully_async": False},
    "node": {"engine.backend": "sglang", "wandb.mode": "online", "async.fully_async": True},
    "three_node": {"engine.backend": "sglang", "wandb.mode": "online", "async.fully_async": True},
}

# Native [core] keys that map onto the structured [async] ones in a low-level file.
CORE_TO_ASYNC = ("fully_async", "async_max_concurrent_samples",
                 "async_data_buffer_capacity_factor", "rollout_submission_granularity")


class ConfigError(ValueError):
    """One or more config errors; each line names the key path, the value and the fix."""

    def __init__(self, errors: list[str], source: str = ""):
        self.errors = list(errors)
        self.source = source
        head = f"invalid run config {source}".rstrip()
        super().__init__(head + ":\n" + "\n".join(f"  {e}" for e in self.errors))

    def __reduce__(self):  # picklable across actors
        return (ConfigError, (self.errors, self.source))


def parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value). The value is TOML value syntax;
    a bare word that is not valid TOML (`run.name=demo`) is taken as a string."""
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected section.key=value"])
    key, raw = item.split("=", 1)
    path = [p.strip() for p in key.strip().split(".")]
    if len(path) < 2 or any(not p for p in path):
        raise ConfigError([f"--set {item!r}: the key must be section.key (e.g. async.fully_async)"])
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    for item in overrides or ():
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError([f"--set {item!r}: {part} is a value, not a table"])
            node = child
        node[path[-1]] = value
    return out


def _get(data: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _resolve_lag(data: dict[str, Any], structured: bool, fully_async: bool) -> tuple[int, list[str]]:
    explicit = {}
    for key in LAG_ALIASES:
        present, value = _get(data, key)
        if present and value is not None:
            explicit[key] = value
    values = set(v for v in explicit.values() if isinstance(v, int) and not isinstance(v, bool))
    if len(values) > 1:
        shown = ", ".join(f"{k} = {v}" for k, v in explicit.items())
        return 0, [f"conflicting policy-lag aliases: {shown}; they are one setting, set one of them"]
    if explicit:
        return next(iter(explicit.values())), []
    return (STRUCTURED_LAG_DEFAULT if structured and fully_async else 0), []


def _structure(data: dict[str, Any]) -> tuple[dict[str, Any], bool, list[str]]:
    """Fold [core] native keys into [async] and decide whether the file is structured."""
    structured = "async" in data or not ("core" in data or "miles" in data)
    errors: list[str] = []
    core = data.get("core", {}) if isinstance(data.get("core", {}), dict) else {}
    if structured:
        for key in CORE_TO_ASYNC:
            if key in core:
                errors.append(f"core.{key} = {core[key]!r}: this file has an [async] table, so it "
                              f"is structured; set async.{key} instead")
    else:
        async_table = data.setdefault("async", {})
        async_table["fully_async"] = core.get("fully_async", False)
        async_table["rollout_submission_granularity"] = core.get("rollout_submission_granularity",
                                                                 "group")
        for key in ("async_max_concurrent_samples", "async_data_buffer_capacity_factor"):
            if key in core:
                async_table[key] = core[key]
    return data, structured, errors


def resolve(data: dict[str, Any], source: str = "") -> RunConfig:
    """Turn a parsed run file (overrides already applied) into a resolved RunConfig."""
    data = copy.deepcopy(data)
    errors: list[str] = []
    profile = _get(data, "run.profile")[1] or "local"
    if profile not in PROFILE_DEFAULTS:
        raise ConfigError([f"run.profile = {profile!r}: allowed are {', '.join(PROFILE_DEFAULTS)}"],
                          source)
    data, structured, fold_errors = _structure(data)
    errors += fold_errors
    for key, value in PROFILE_DEFAULTS[profile].items():
        if not _get(data, key)[0] or _get(data, key)[1] is None:
            if key == "async.fully_async" and not structured:
                continue  # low-level files keep the native (synchronous) default
            _set(data, key, value)
    fully_async = bool(_get(data, "async.fully_async")[1])
    lag, lag_errors = _resolve_lag(data, structured, fully_async)
    errors += lag_errors
    if not structured and fully_async and lag <= 0:
        errors.append("core.fully_async = true needs a positive core.max_policy_lag (the low-level "
                      "default is 0); set e.g. core.max_policy_lag = 6")
    data.setdefault("async", {})["max_weight_staleness"] = lag
    for alias in LAG_ALIASES[1:]:
        section, key = alias.split(".")
        if isinstance(data.get(section), dict):
            data[section][key] = lag
    mrr_present, mrr = _get(data, "sglang.max_running_requests")
    if _get(data, "sglang.server_concurrency")[1] is None and (not mrr_present or isinstance(mrr, int)):
        base = mrr if mrr_present else 8
        _set(data, "sglang.server_concurrency", 2 * base if structured else base)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        errors += [_format_pydantic(e) for e in exc.errors()]
        raise ConfigError(errors, source) from None
    if errors:
        raise ConfigError(errors, source)
    cfg._structured = structured
    return cfg


def _format_pydantic(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"] if p != "async_") or "<file>"
    path = path.replace("async_.", "async.")
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown key"
    if err["type"] == "missing":
        return f"{path}: required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error":
        return f"{path}: {msg}" if path != "<file>" else msg
    return f"{path} = {err.get('input')!r}: {msg}"


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"run file {str(p)!r} does not exist"])
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{p}: not valid TOML: {exc}"], str(p)) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load, override, resolve. Raises ConfigError listing every problem found."""
    return resolve(apply_overrides(load_toml(path), overrides), str(path))
