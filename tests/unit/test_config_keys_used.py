"""Every config key is read by the run, off the config object itself.

Reads are resolved in the product's syntax trees, not by name: `<cfg>.<section>.<key>`
where `<cfg>` is the run config (`cfg`, `self.cfg`, `fleet.cfg`, `self.fleet.cfg`, ...), and
`<alias>.<key>` where `<alias>` was assigned `<cfg>.<section>` in the same function
(`t = cfg.train`, `c, gpu = cfg.cluster, ...`). A key whose name only matches some other
attribute (`ops.drain(` is not `eval.drain`) does not count, and neither does validate:
rl_async/plan/ (checks, capacity, memory) reads keys to judge them, not to run with them;
the keys whose whole job is the plan are listed in PLAN_ONLY. The native low-level tables
([core], [miles]) are mapped onto [async] by the loader (rl_async/plan/load.py): their keys
must appear there.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel

from rl_async.plan.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("rl_async", "actors", "launch")
NOT_RUN = ("rl_async/plan/",)  # validate, the capacity and memory plans, the loader
NATIVE = {"core", "miles"}
PLAN_ONLY = {
    "cluster.gpu_memory_gb": "the memory plan: per-GPU estimates against it",
    "model.architecture": "the memory plan where model.path is not readable",
    "publication.bytes_per_s": "validate's publication deadline arithmetic (transfer time)",
}
# Keys the run reads through what is resolved from them once: the capacity plan (the one
# source of truth for limits) or a RunConfig property (a profile-dependent default).
DERIVED = {
    "engine.fault_tolerance": ("cfg", "fault_tolerance"),
    "async.fully_async": ("cfg", "fully_async"),
    "sglang.server_concurrency": ("plan", "http_slots"),  # server_concurrency x engines
    "rollout.rollout_batch_size": ("plan", "rollout_batch_size"),
    "train.global_batch_size": ("plan", "global_batch_size"),
    "async.async_max_concurrent_samples": ("plan", "producer_samples"),
    "async.async_data_buffer_capacity_factor": ("plan", "completed_buffer_groups"),
    "async.rollout_submission_granularity": ("plan", "submission_granularity"),
    "async.max_weight_staleness": ("plan", "max_weight_staleness"),
    "async.staleness_bound": ("plan", "staleness_bound"),
    "async.hold_back_collections": ("plan", "hold_back_groups"),
}


def leaf_keys(model: type[BaseModel]):
    for name, field in model.model_fields.items():
        section = field.alias or name
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            for key in ann.model_fields:
                yield section, key


def _is_config(node: ast.AST) -> bool:
    """`cfg`, or any attribute chain ending in `.cfg` (self.cfg, fleet.cfg, ...)."""
    return (isinstance(node, ast.Name) and node.id == "cfg") or (
        isinstance(node, ast.Attribute) and node.attr == "cfg")


def _section_of(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The section `node` denotes: `<cfg>.<section>`, or a name aliased to one."""
    if isinstance(node, ast.Attribute) and _is_config(node.value):
        return node.attr.removesuffix("_")  # [async] is the attribute `async_`
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def _assign_aliases(scope: ast.AST, aliases: dict[str, str]) -> None:
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = (zip(target.elts, value.elts) if isinstance(target, ast.Tuple)
                     and isinstance(value, ast.Tuple) else [(target, value)])
            for t, v in pairs:
                section = _section_of(v, {})
                if isinstance(t, ast.Name) and section is not None:
                    aliases[t.id] = section


def _scopes(tree: ast.AST) -> list:
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]


def passed_sections(trees: list[ast.AST]) -> dict[tuple[str, int], str]:
    """(function name, parameter index) -> section, for calls that pass `<cfg>.<section>`
    (`build_prompts(cfg.task, ...)`: inside it, `task_cfg` is the [task] section)."""
    out = {}
    for tree in trees:
        for scope in _scopes(tree):
            aliases: dict[str, str] = {}
            _assign_aliases(scope, aliases)
            for node in ast.walk(scope):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    for i, arg in enumerate(node.args):
                        section = _section_of(arg, aliases)
                        if name and section is not None:
                            out[(name, i)] = section
    return out


def reads(tree: ast.AST, passed: dict[tuple[str, int], str] | None = None) -> set[str]:
    """Every `section.key` read off the run config in a module, function by function, and
    `cfg.<attr>` / `plan.<attr>` reads as `cfg:<attr>` / `plan:<attr>`."""
    found: set[str] = set()
    for scope in _scopes(tree):
        aliases: dict[str, str] = {}
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and passed:
            params = [a.arg for a in scope.args.args]
            offset = 1 if params[:1] in (["self"], ["cls"]) else 0
            for i, param in enumerate(params[offset:]):
                if (scope.name, i) in passed:
                    aliases[param] = passed[(scope.name, i)]
        _assign_aliases(scope, aliases)
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute):
                section = _section_of(node.value, aliases)
                if section is not None:
                    found.add(f"{section}.{node.attr}")
                if _is_config(node.value):
                    found.add(f"cfg:{node.attr}")
                if (isinstance(node.value, ast.Name) and node.value.id == "plan") or (
                        isinstance(node.value, ast.Attribute) and node.value.attr == "plan"):
                    found.add(f"plan:{node.attr}")
    return found


def product_reads(exclude=NOT_RUN) -> set[str]:
    trees = [ast.parse(path.read_text(), str(path)) for d in PRODUCT
             for path in (ROOT / d).rglob("*.py")
             if not str(path.relative_to(ROOT)).startswith(exclude)]
    passed = passed_sections(trees)
    return set().union(*(reads(tree, passed) for tree in trees))


def test_every_config_key_is_read_by_the_run():
    found = product_reads()
    for key, (obj, attr) in DERIVED.items():  # read through what was resolved from it
        if f"{obj}:{attr}" in found:
            found.add(key)
    unread = [f"{s}.{k}" for s, k in leaf_keys(RunConfig)
              if s not in NATIVE and f"{s}.{k}" not in found and f"{s}.{k}" not in PLAN_ONLY]
    assert not unread, f"config keys the run never reads: {unread}"


def test_derived_keys_are_what_the_plan_resolves():
    from rl_async.plan.capacity import CapacityPlan

    plan_fields = set(CapacityPlan.__dataclass_fields__)
    for key, (obj, attr) in DERIVED.items():
        assert attr in (plan_fields if obj == "plan" else dir(RunConfig)), (key, attr)


def test_plan_only_keys_are_read_by_the_plan_and_by_nothing_else():
    plan = set()
    for path in (ROOT / "rl_async" / "plan").rglob("*.py"):
        plan |= reads(ast.parse(path.read_text()))
    run = product_reads()
    for key in PLAN_ONLY:
        assert key in plan and key not in run, key


def test_native_tables_are_mapped_by_the_loader():
    loader = (ROOT / "rl_async" / "plan" / "load.py").read_text()
    unmapped = [f"{s}.{k}" for s, k in leaf_keys(RunConfig) if s in NATIVE
                and f'"{k}"' not in loader and f"{s}.{k}" not in loader]
    assert not unmapped, unmapped


def test_the_check_fails_when_a_key_is_not_read():
    """Shown failing: the controller without its read of eval.drain, while `ops.drain(` and
    `self.drain(` stay in the product (the old name-matching test counted those)."""
    controller = (ROOT / "rl_async" / "loop" / "controller.py").read_text()
    assert "self.cfg.eval.drain" in controller
    assert "eval.drain" in reads(ast.parse(controller))
    assert "eval.drain" not in reads(ast.parse(controller.replace("self.cfg.eval.drain",
                                                                  "False")))
    aliased = ast.parse("def f(cfg):\n    e = cfg.eval\n    x.drain()\n    return e.every_steps")
    assert {r for r in reads(aliased) if "." in r} == {"eval.every_steps"}
