"""The README is a guide with docs/ behind it, and every page stays true to the code:

- every relative link resolves to a file (and a heading, when it names one);
- every repository path a page names (in a code block or inline code) exists, and every
  `rl-async` subcommand in a code block is one the CLI has;
- every config key a page names (`section.key`, `--set section.key=...`, a TOML block) is a
  key of the config classes;
- the guide pages (all but docs/benchmarks.md, where figures and their history live) read as
  a guide: no dates, no "final code", no issue or SPEC section numbers;
- the README keeps the two set-up commands, and the repository its licence;
- the README's bold figures are the benchmarks page's.
"""

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from rl_async.plan.reference import all_keys

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDE = [p for p in PAGES if p.name != "benchmarks.md"]
SECTIONS = sorted({k.split(".")[0] for k in all_keys()})
KEYS = set(all_keys())
# Run-summary fields, file and module names that start like a config key, and the typo
# troubleshooting.md shows on purpose: not keys.
NOT_KEYS = {"rollout.trajectories", "rollout.turns_mean", "rollout.truncated_fraction",
            "rollout.env_seconds_mean", "eval.curve", "eval.initial", "model.config",
            "train.py", "async.json", "sglang.launch_server", "async.max_weigth_staleness"}
# The repository's own top-level folders (a run's output folders are not the repository's).
OUTPUTS = {"runs", "wandb", "build", "dist", "__pycache__"}
TOP = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
             and p.name not in OUTPUTS and not p.name.endswith(".egg-info"))
PATH = re.compile(rf"(?<![\w/.~-])((?:{'|'.join(map(re.escape, TOP))})/[\w./*-]*[\w*])")
KEY = re.compile(rf"(?<![\w.\[/-])((?:{'|'.join(SECTIONS)})\.[a-z_][a-z0-9_]*)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(line.lstrip("#")) for line in page.read_text().splitlines()
            if line.startswith("#")}


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def _inline(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{_rel(page)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{_rel(page)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _exists(path: str) -> bool:
    path = path.rstrip("/.")
    if "*" in path:
        return any(fnmatch.fnmatch(str(p.relative_to(ROOT)), path) for p in ROOT.rglob("*")
                   if ".venv" not in p.parts)
    return (ROOT / path).exists()


def test_every_repository_path_a_page_names_exists():
    missing = []
    for page in PAGES:
        text = page.read_text()
        spans = [body for _, body in _blocks(text)] + _inline(text)
        for span in spans:
            for path in PATH.findall(span):
                if not _exists(path):
                    missing.append(f"{_rel(page)}: {path}")
    assert not missing, "pages name files that do not exist:\n" + "\n".join(sorted(set(missing)))


def _subcommands() -> set[str]:
    from launch.cli import main

    return set(main.commands)


def test_every_rl_async_command_in_a_code_block_exists():
    known, unknown = _subcommands(), []
    for page in PAGES:
        for lang, body in _blocks(page.read_text()):
            if lang not in ("bash", "sh", ""):
                continue
            for sub in re.findall(r"(?:^|[\s/])rl-async\s+([a-z][\w-]*)", body, re.M):
                if sub not in known:
                    unknown.append(f"{_rel(page)}: rl-async {sub}")
    assert not unknown, f"commands the CLI does not have ({sorted(known)}):\n" + "\n".join(unknown)


def _toml_keys(body: str) -> list[str]:
    """section.key of every key in a TOML block (run files only: the first table decides)."""
    try:
        data = tomllib.loads(body)
    except tomllib.TOMLDecodeError:
        return []
    if not set(data) <= set(SECTIONS):
        return []  # not a run file (pyproject.toml, a dataset config, ...)
    return [f"{s}.{k}" for s, table in data.items() if isinstance(table, dict) for k in table]


def test_every_config_key_a_page_names_exists():
    wrong = []
    for page in PAGES:
        text = page.read_text()
        named = [k for span in _inline(text) for k in KEY.findall(span)]
        for lang, body in _blocks(text):
            named += _toml_keys(body) if lang == "toml" else KEY.findall(body)
        wrong += [f"{_rel(page)}: {k}" for k in named if k not in KEYS and k not in NOT_KEYS]
    assert not wrong, ("pages name config keys the config classes do not have (a run-summary "
                       "field is written summary[\"section\"][\"field\"]):\n"
                       + "\n".join(sorted(set(wrong))))


NOTEBOOK = [(re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a date"),
            (re.compile(r"final code", re.I), '"final code"'),
            (re.compile(r"\bissue #?\d+", re.I), "an issue number"),
            (re.compile(r"SPEC §|§\s?\d"), "a SPEC section"),
            (re.compile(r"\baudit #?\d+", re.I), "an audit number")]


@pytest.mark.parametrize("page", GUIDE, ids=[p.name for p in GUIDE])
def test_guide_pages_read_as_a_guide_not_a_lab_notebook(page):
    found = [f"line {i}: {what}: {line.strip()[:100]}"
             for i, line in enumerate(page.read_text().splitlines(), start=1)
             for pattern, what in NOTEBOOK if pattern.search(line)]
    assert not found, (f"{_rel(page)} is a guide: history, dates and internal references go "
                       f"in git or docs/benchmarks.md\n" + "\n".join(found))


def test_the_readme_is_a_guide_not_a_manual():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    # the two set-up commands, exactly
    assert "bash scripts/setup.sh && .venv/bin/rl-async run cluster_configs/local.toml\n" in text
    assert ("bash scripts/setup.sh && RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/pytest -q\n"
            in text)


def test_the_licence_is_there():
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_the_readme_quotes_figures_only_from_the_benchmarks_page():
    # A figure in bold ("**1.34x**") the benchmarks table does not hold is a figure nobody
    # can trace to a command, a date and its conditions.
    readme = (ROOT / "README.md").read_text()
    table = (ROOT / "docs" / "benchmarks.md").read_text()
    figures = re.findall(r"\*\*(\d+(?:\.\d+)?x)\*\*", readme)
    assert figures, "the README quotes its headline figures in bold"
    missing = [f for f in figures if f"**{f}**" not in table]
    assert not missing, f"README figures not in docs/benchmarks.md: {missing}"
