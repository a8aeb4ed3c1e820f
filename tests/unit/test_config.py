"""Run-file loading: unknown keys, --set, profiles, structured vs low-level, lag aliases."""

from pathlib import Path

import pytest

from rl_async.plan.load import ConfigError, load_config, parse_override, resolve

MODEL = {"hf_config": {"model_type": "llama", "vocab_size": 16}}


def cfg_of(data: dict):
    data = {"model": MODEL, **data}
    return resolve(data)


def errors_of(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        cfg_of(data)
    return exc.value.errors


def test_unknown_key_names_full_path():
    errs = errors_of({"async": {"max_weigth_staleness": 2}})
    assert "async.max_weigth_staleness: unknown key" in errs


def test_unknown_section_and_nested_key():
    assert "bogus: unknown key" in errors_of({"bogus": {"x": 1}})
    assert "rollout.temprature: unknown key" in errors_of({"rollout": {"temprature": 1.0}})


def test_bad_value_names_key_and_value():
    (err,) = errors_of({"async": {"buffer_order": "random"}})
    assert err.startswith("async.buffer_order = 'random'") and "fifo" in err and "lifo" in err


def test_model_needs_exactly_one_source():
    with pytest.raises(ConfigError) as exc:
        resolve({"model": {}})
    assert any("model.hf_config" in e and "model.path" in e for e in exc.value.errors)


@pytest.mark.parametrize("item,path,value", [
    ("async.fully_async=false", ["async", "fully_async"], False),
    ("rollout.temperature=0.7", ["rollout", "temperature"], 0.7),
    ("run.name=demo", ["run", "name"], "demo"),
    ('run.name="quoted"', ["run", "name"], "quoted"),
    ("model.hf_config.hidden_size=32", ["model", "hf_config", "hidden_size"], 32),
    ("sglang.extra_args={ a = 1 }", ["sglang", "extra_args"], {"a": 1}),
])
def test_parse_override(item, path, value):
    assert parse_override(item) == (path, value)


@pytest.mark.parametrize("item", ["novalue", "=3", "section=3", "a..b=1"])
def test_parse_override_rejects(item):
    with pytest.raises(ConfigError):
        parse_override(item)


def test_set_overrides_file(tmp_path: Path):
    f = tmp_path / "r.toml"
    f.write_text('[model]\nhf_config = { model_type = "llama" }\n[async]\nmax_weight_staleness = 3\n')
    assert load_config(f).max_weight_staleness == 3
    assert load_config(f, ["async.max_weight_staleness=1"]).max_weight_staleness == 1


def test_missing_file_and_bad_toml(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


@pytest.mark.parametrize("profile,backend,fully_async,lag,wandb", [
    ("local", "embedded", True, 6, "offline"),
    ("dev", "embedded", False, 0, "offline"),
    ("node", "sglang", True, 6, "online"),
    ("three_node", "sglang", True, 6, "online"),
])
def test_profile_defaults(profile, backend, fully_async, lag, wandb):
    cfg = cfg_of({"run": {"profile": profile}, "async": {}})
    assert cfg.engine.backend == backend
    assert cfg.fully_async is fully_async
    assert cfg.max_weight_staleness == lag
    assert cfg.wandb.mode == wandb
    assert cfg.structured


def test_file_value_beats_profile_default():
    cfg = cfg_of({"run": {"profile": "dev"}, "async": {"fully_async": True}})
    assert cfg.fully_async and cfg.max_weight_staleness == 6


def test_bad_profile():
    errs = errors_of({"run": {"profile": "cloud"}})
    assert "run.profile = 'cloud'" in errs[0]


def test_structured_server_concurrency_default_is_two_waves():
    cfg = cfg_of({"async": {}, "sglang": {"max_running_requests": 16}})
    assert cfg.sglang.server_concurrency == 32


def test_low_level_keeps_native_defaults():
    cfg = cfg_of({"core": {"max_policy_lag": 0}, "sglang": {"max_running_requests": 16}})
    assert not cfg.structured
    assert not cfg.fully_async
    assert cfg.max_weight_staleness == 0
    assert cfg.sglang.server_concurrency == 16
    assert cfg.async_.rollout_submission_granularity == "group"


def test_low_level_async_needs_positive_lag():
    errs = errors_of({"core": {"fully_async": True}})
    assert any("core.fully_async" in e and "core.max_policy_lag" in e for e in errs)
    cfg = cfg_of({"core": {"fully_async": True, "max_policy_lag": 4}})
    assert cfg.fully_async and cfg.max_weight_staleness == 4


def test_low_level_alias_via_miles_counts_as_positive_lag():
    cfg = cfg_of({"core": {"fully_async": True}, "miles": {"max_weight_staleness": 3}})
    assert cfg.max_weight_staleness == 3 and cfg.core.max_policy_lag == 3


def test_structured_file_rejects_core_native_keys():
    errs = errors_of({"async": {}, "core": {"fully_async": True}})
    assert any("core.fully_async" in e and "async.fully_async" in e for e in errs)


@pytest.mark.parametrize("tables", [
    {"async": {"max_weight_staleness": 2}},
    {"async": {}, "core": {"max_policy_lag": 2}},
    {"async": {}, "miles": {"max_weight_staleness": 2}},
    {"async": {"max_weight_staleness": 2}, "core": {"max_policy_lag": 2}},
])
def test_any_explicit_alias_overrides_default(tables):
    cfg = cfg_of(tables)
    assert cfg.max_weight_staleness == 2


def test_conflicting_aliases_name_both_keys_and_values():
    errs = errors_of({"async": {"max_weight_staleness": 2}, "miles": {"max_weight_staleness": 4}})
    (err,) = [e for e in errs if "conflicting" in e]
    assert "async.max_weight_staleness = 2" in err and "miles.max_weight_staleness = 4" in err


def test_config_pickles_with_structure_flag():
    import pickle

    cfg = cfg_of({"core": {"max_policy_lag": 1}})
    back = pickle.loads(pickle.dumps(cfg))
    assert back.structured is False and back.max_weight_staleness == 1
