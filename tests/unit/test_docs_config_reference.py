"""docs/configuration.md's key reference is generated from the config classes: every key has
an entry (meaning, unit, plan rule) in rl_async/plan/key_docs.py, and the page's generated
block is exactly what the generator prints now. `rl-async config FILE` prints a resolved run
file that resolves to the same configuration."""

import json
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from launch.cli import main
from rl_async.plan import reference
from rl_async.plan.capacity import plan_capacity
from rl_async.plan.load import load_config, resolve
from rl_async.plan.resolved import resolved_dict, resolved_toml

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
HOW = (f"add an entry `\"section.key\": Doc(meaning, unit, rule)` to KEYS in "
       f"rl_async/plan/key_docs.py, then regenerate the page: `{reference.REGENERATE}` "
       f"(and commit docs/configuration.md)")


def test_every_config_key_has_a_reference_entry():
    missing = reference.missing_entries()
    assert not missing, f"config keys without a reference entry: {missing}; {HOW}"


def test_no_reference_entry_for_a_key_that_is_gone():
    stale = reference.stale_entries()
    assert not stale, (f"rl_async/plan/key_docs.py documents keys the config classes do not "
                       f"have: {stale}; remove them, then run `{reference.REGENERATE}`")


def test_the_page_is_what_the_generator_prints():
    block = reference.page_block(PAGE.read_text())
    assert block is not None, f"docs/configuration.md lost its markers {reference.BEGIN!r}"
    assert block == reference.reference_markdown(), (
        f"docs/configuration.md's key reference is out of date with the config classes or "
        f"rl_async/plan/key_docs.py: run `{reference.REGENERATE}` and commit the page")


def test_every_key_is_in_the_page():
    block = reference.page_block(PAGE.read_text())
    absent = [k for k in reference.all_keys() if f"| `{k}` |" not in block]
    assert not absent, absent


def test_types_and_defaults_come_from_the_classes():
    md = reference.reference_markdown()
    assert "| `train.lr` | float > 0 | 0.001 |" in md
    assert "| `engine.backend` | `embedded` / `sglang` / `synthetic`, or unset | " \
           '"embedded" (local, dev); "sglang" (node, three_node) |' in md
    assert "| `train.global_batch_size` | int > 0, or unset | unset | samples |" in md
    assert "| `sglang.extra_args` | table | {} |" in md


def test_write_replaces_only_the_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nbefore\n\n{reference.BEGIN}\nold\n{reference.END}\n\nafter\n")
    assert reference.write_reference(page)
    text = page.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert reference.page_block(text) == reference.reference_markdown()
    assert not reference.write_reference(page)  # a second run changes nothing
    page.write_text("no markers\n")
    with pytest.raises(ValueError, match="no key-reference markers"):
        reference.write_reference(page)


CONFIGS = sorted((ROOT / "cluster_configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_the_resolved_file_resolves_to_the_same_config(path):
    cfg = load_config(path)
    again = resolve(tomllib.loads(resolved_toml(cfg, str(path))), "resolved")
    assert resolved_dict(again) == resolved_dict(cfg)
    assert plan_capacity(again)[0] == plan_capacity(cfg)[0]


def test_a_low_level_file_keeps_its_native_defaults(tmp_path):
    path = tmp_path / "low.toml"
    path.write_text('[model]\nhf_config = { model_type = "llama", vocab_size = 16 }\n'
                    "[core]\nfully_async = true\nmax_policy_lag = 2\n"
                    "[rollout]\nrollout_batch_size = 8\nn_samples_per_prompt = 4\n")
    cfg = load_config(path)
    text = resolved_toml(cfg, str(path))
    assert "low-level" in text.splitlines()[0] and "[core]" not in text
    again = resolve(tomllib.loads(text), "resolved")
    assert plan_capacity(again)[0] == plan_capacity(cfg)[0]  # one collection of budget, not 2x


def test_config_command_prints_toml_and_json_with_overrides():
    runner = CliRunner()
    local = str(ROOT / "cluster_configs" / "local.toml")
    out = runner.invoke(main, ["config", local, "--set", "train.lr=5e-5"])
    assert out.exit_code == 0, out.output
    data = tomllib.loads(out.output)
    assert data["train"]["lr"] == 5e-5
    assert data["engine"]["backend"] == "embedded"   # the profile's default, filled in
    assert data["async"]["max_weight_staleness"] == 2
    assert "# prefix_cache_tokens: unset" in out.output
    js = runner.invoke(main, ["config", local, "--json"])
    assert js.exit_code == 0 and json.loads(js.output)["wandb"]["mode"] == "offline"
    bad = runner.invoke(main, ["config", local, "--set", "train.lrr=1"])
    assert bad.exit_code == 2 and "train.lrr: unknown key" in bad.output
    assert runner.invoke(main, ["config"]).exit_code == 2  # neither FILE nor --reference


def test_config_reference_command_prints_the_generated_block():
    out = CliRunner().invoke(main, ["config", "--reference"])
    assert out.exit_code == 0 and out.output.strip() == reference.reference_markdown()
