"""The resolved run config as a run file: every key with the value the run will use.

`rl-async config FILE [--set k=v]` prints it: the section defaults, the profile's defaults,
the derived values (policy lag, HTTP permits) and the file's own values, after `--set`.
The output is itself a valid structured run file that resolves to the same config.
[core] and [miles] are left out: they are low-level aliases the loader has folded into
[async]. TOML has no null, so an unset key is printed as a comment.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from rl_async.plan.config import RunConfig

ALIASES = ("core", "miles")  # folded into [async] by the loader
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def resolved_dict(cfg: RunConfig) -> dict[str, Any]:
    """Section -> key -> value, aliases left out; None = unset. A low-level file's unset
    producer budget is its native default, one collection, written out: the output has an
    [async] table, and a structured file would derive the budget from the fleet instead."""
    out = {s: v for s, v in cfg.to_dict().items() if s not in ALIASES}
    if not cfg.structured and out["async"]["async_max_concurrent_samples"] is None:
        r = cfg.rollout
        out["async"]["async_max_concurrent_samples"] = r.rollout_batch_size * r.n_samples_per_prompt
    return out


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = [f"{_key(k)} = {toml_value(x)}" for k, x in v.items() if x is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise TypeError(f"cannot write {v!r} ({type(v).__name__}) as TOML")


def resolved_toml(cfg: RunConfig, source: str = "") -> str:
    mode = "fully async" if cfg.fully_async else "synchronous"
    lines = [f"# resolved from {source or 'the run file'}: profile {cfg.run.profile!r}, "
             f"{'structured' if cfg.structured else 'low-level'}, {mode}, lag "
             f"{cfg.max_weight_staleness}",
             "# every key with the value the run uses; '# key: unset' = no value"]
    for section, values in resolved_dict(cfg).items():
        lines += ["", f"[{section}]"]
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key}: unset")
            else:
                lines.append(f"{_key(key)} = {toml_value(value)}")
    return "\n".join(lines) + "\n"
