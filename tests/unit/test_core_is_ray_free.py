"""DESIGN principle 1: the pure core `rl_async` never imports Ray."""

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import rl_async

ROOT = Path(rl_async.__file__).parent


def test_no_ray_import_statement_in_core():
    offenders = [str(p) for p in ROOT.rglob("*.py")
                 if re.search(r"^\s*(import ray|from ray)\b", p.read_text(), re.M)]
    assert not offenders


def test_importing_every_core_module_does_not_load_ray():
    names = [m.name for m in pkgutil.walk_packages([str(ROOT)], "rl_async.")]
    code = ("import importlib, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
