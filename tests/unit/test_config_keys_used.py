"""Every config key does something: a key that no product code reads fails this test.

A key counts as read when some module outside the config loader accesses it as an attribute
(`cfg.section.key`, `s.key`) or names it as a string (`getattr(section, "key")`). Keys that belong to work still open are listed
below with the issue that wires them; remove them from the list when it lands.
"""

import re
from pathlib import Path

from pydantic import BaseModel

from rl_async.plan.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("rl_async", "actors", "launch")
LOADER = {"rl_async/plan/config.py", "rl_async/plan/load.py"}
# Native low-level tables: read only by the loader, which maps them onto [async].
NATIVE = {"core", "miles"}
NOT_YET: dict[str, str] = {}


def leaf_keys(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        key = field.alias or name
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if key not in NATIVE:
                yield from ((key, leaf) for _, leaf in leaf_keys(ann))
        else:
            yield prefix, name


def product_source() -> str:
    files = [p for d in PRODUCT for p in (ROOT / d).rglob("*.py")
             if str(p.relative_to(ROOT)) not in LOADER]
    return "\n".join(p.read_text() for p in files)


def section_refs(source: str, section: str) -> set[str]:
    """How code refers to a section: `cfg.<section>` and local aliases of it
    (`r = cfg.reward`, `r, j = cfg.reward, cfg.judge`)."""
    refs = {rf"\b{section}_?"}  # [async] is the attribute `async_`
    for lhs, rhs in re.findall(r"^\s*([\w, ]+?)\s*=\s*([\w., ]+)$", source, re.M):
        names = [n.strip() for n in lhs.split(",")]
        values = [v.strip() for v in rhs.split(",")]
        for name, value in zip(names, values):
            if re.fullmatch(rf"(self\.)?(cfg|config|self\.cfg)\.{section}_?", value):
                refs.add(rf"\b{name}")
    return refs


def is_read(source: str, section: str, key: str, ambiguous: bool) -> bool:
    k = re.escape(key)
    if not ambiguous:  # a name only one section has: any attribute access or string
        return bool(re.search(rf"\.{k}\b|[\"']{k}[\"']", source))
    # a name several sections share (timeout_s, ...): it must be read off this section
    return any(re.search(rf"{ref}\.{k}\b", source) for ref in section_refs(source, section))


def test_every_config_key_is_read_somewhere():
    source = product_source()
    keys = list(leaf_keys(RunConfig))
    names = [k for _, k in keys]
    unread = [f"{section}.{key}" for section, key in keys
              if f"{section}.{key}" not in NOT_YET
              and not is_read(source, section, key, names.count(key) > 1)]
    assert not unread, f"config keys that nothing reads: {unread}"


def test_the_not_yet_list_is_still_true():
    """A key wired in since must leave NOT_YET (so the list cannot hide a regression). Being
    read by validate (rl_async/plan/checks.py) alone does not make a key do anything."""
    checks = ROOT / "rl_async" / "checks.py"
    source = "\n".join(p.read_text() for d in PRODUCT for p in (ROOT / d).rglob("*.py")
                       if str(p.relative_to(ROOT)) not in LOADER and p != checks)
    names = [k for _, k in leaf_keys(RunConfig)]
    for full in NOT_YET:
        section, key = full.split(".")
        assert not is_read(source, section, key, names.count(key) > 1), \
            f"{full} is read now: remove it from NOT_YET"
