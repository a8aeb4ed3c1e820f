"""Capacity plan formulas (SPEC §3), rounding, warning codes and errors."""

import math

import pytest

from rl_async.plan.checks import validate
from rl_async.plan.load import resolve

MODEL = {"hf_config": {"model_type": "llama"}}


def report(**sections):
    data = {"model": MODEL, "async": {}}
    for k, v in sections.items():
        data.setdefault(k.rstrip("_"), {}).update(v)
    return validate(resolve(data))


def codes(r):
    return {w.code for w in r.warnings}


def test_derived_defaults_match_spec_formulas():
    r = report(cluster={"inference_gpus": 8, "gpus_per_engine": 2},
               sglang={"max_running_requests": 16},
               rollout={"rollout_batch_size": 4, "n_samples_per_prompt": 8},
               async_={"async_data_buffer_capacity_factor": 1.5})
    p = r.plan
    assert p.engines == 4
    assert p.server_concurrency == 32
    assert p.http_slots == 128 and p.engine_slots == 64
    assert p.requested_slots == 4 * min(32, 16) == 64
    assert p.collection_samples == 32
    assert p.producer_samples == 128 and p.producer_groups == 16
    assert p.completed_buffer_groups == math.floor(1.5 * 4) == 6
    assert p.completed_buffer_samples == 48
    assert p.max_weight_staleness == 6
    assert p.global_batch_size == 32 and p.optimizer_steps_per_collection == 1
    assert p.submission_granularity == "sample"


def test_producer_rounds_up_to_whole_groups_when_derived():
    r = report(cluster={"cpu_engines": 1}, sglang={"max_running_requests": 5},
               rollout={"rollout_batch_size": 1, "n_samples_per_prompt": 4})
    # 2 x requested = 2 x 5 = 10 -> 12 (three groups of four).
    assert r.plan.producer_samples == 12 and r.plan.producer_groups == 3


def test_cpu_engines_used_without_gpus():
    assert report(cluster={"cpu_engines": 3}).plan.engines == 3


def test_explicit_server_concurrency_kept():
    r = report(sglang={"max_running_requests": 16, "server_concurrency": 8})
    assert r.plan.server_concurrency == 8 and r.plan.requested_slots == 8
    assert "HTTP_GATE_BELOW_ENGINE" in codes(r)


@pytest.mark.parametrize("explicit,expected,rounded", [(32, 32, False), (30, 28, True),
                                                       (3, 4, True), (4, 4, False)])
def test_explicit_producer_rounds_down_never_below_one_group(explicit, expected, rounded):
    r = report(rollout={"n_samples_per_prompt": 4},
               async_={"async_max_concurrent_samples": explicit})
    assert r.plan.producer_samples == expected
    assert ("GROUP_ROUNDING" in codes(r)) is rounded


@pytest.mark.parametrize("value", [0, -8])
def test_nonpositive_producer_is_error(value):
    r = report(async_={"async_max_concurrent_samples": value})
    assert not r.ok
    assert any(f"async.async_max_concurrent_samples = {value}" in e for e in r.errors)


def test_zero_group_buffer_is_error():
    r = report(rollout={"rollout_batch_size": 4}, async_={"async_data_buffer_capacity_factor": 0.2})
    assert any("async.async_data_buffer_capacity_factor = 0.2" in e for e in r.errors)


def test_gpus_per_engine_must_divide():
    r = report(cluster={"inference_gpus": 6, "gpus_per_engine": 4})
    assert any("cluster.gpus_per_engine = 4" in e and "cluster.inference_gpus = 6" in e
               for e in r.errors)


def test_global_batch_must_divide_collection():
    r = report(rollout={"rollout_batch_size": 4, "n_samples_per_prompt": 4},
               train={"global_batch_size": 6})
    assert any("train.global_batch_size = 6" in e for e in r.errors)


def test_producer_below_fleet():
    r = report(sglang={"max_running_requests": 32}, cluster={"cpu_engines": 2},
               rollout={"n_samples_per_prompt": 4}, async_={"async_max_concurrent_samples": 16})
    assert "PRODUCER_BELOW_FLEET" in codes(r) and "NO_HEADROOM" in codes(r)


def test_no_headroom_boundary_is_inclusive():
    # producer == engine slots: min(16, 32) <= 16 -> warn.
    r = report(sglang={"max_running_requests": 16}, rollout={"n_samples_per_prompt": 4},
               async_={"async_max_concurrent_samples": 16})
    assert "NO_HEADROOM" in codes(r)
    r = report(sglang={"max_running_requests": 16}, rollout={"n_samples_per_prompt": 4},
               async_={"async_max_concurrent_samples": 20})
    assert "NO_HEADROOM" not in codes(r)


def test_buffer_smaller_than_collection():
    r = report(rollout={"rollout_batch_size": 8}, async_={"async_data_buffer_capacity_factor": 0.5})
    assert r.plan.completed_buffer_groups == 4
    assert "BUFFER_SMALLER_THAN_COLLECTION" in codes(r)


def test_buffer_exceeds_age_budget_and_retained_exceeds_lag():
    # collection 8 x 4 = 32, gbs 16, buffer factor 2 -> 64 samples = 4 batches > lag 2.
    r = report(rollout={"rollout_batch_size": 8, "n_samples_per_prompt": 4},
               train={"global_batch_size": 16},
               async_={"async_data_buffer_capacity_factor": 2.0, "max_weight_staleness": 2})
    assert {"BUFFER_EXCEEDS_AGE_BUDGET", "RETAINED_EXCEEDS_LAG"} <= codes(r)
    r = report(rollout={"rollout_batch_size": 8, "n_samples_per_prompt": 4},
               train={"global_batch_size": 16}, async_={"max_weight_staleness": 20})
    assert not {"BUFFER_EXCEEDS_AGE_BUDGET", "RETAINED_EXCEEDS_LAG"} & codes(r)


def test_retained_exceeds_lag_formula():
    # producer 32 + buffer 16 = 48 > 2 x 16 = 32 (the seed's 64 + 32 example, halved).
    r = report(sglang={"max_running_requests": 8}, rollout={"rollout_batch_size": 4,
               "n_samples_per_prompt": 4}, train={"global_batch_size": 16},
               async_={"max_weight_staleness": 2, "async_max_concurrent_samples": 32})
    assert r.plan.producer_samples + r.plan.completed_buffer_samples == 48
    assert "RETAINED_EXCEEDS_LAG" in codes(r)


def test_lag_warnings_skipped_for_synchronous_runs():
    r = report(run={"profile": "dev"})
    assert not {"BUFFER_EXCEEDS_AGE_BUDGET", "RETAINED_EXCEEDS_LAG"} & codes(r)


def test_lag_warnings_skipped_at_lag_zero():
    # Async at lag 0 opens one collection per version (controller.generates_per_collection):
    # nothing can age out, so the age-budget warnings would be false alarms.
    r = report(async_={"max_weight_staleness": 0})
    assert r.plan.fully_async
    assert not {"BUFFER_EXCEEDS_AGE_BUDGET", "RETAINED_EXCEEDS_LAG"} & codes(r)


def test_low_level_producer_default_is_one_collection():
    r = validate(resolve({"model": MODEL, "core": {"fully_async": True, "max_policy_lag": 2},
                          "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 4}}))
    assert r.plan.producer_samples == 8 and "GROUP_ROUNDING" not in codes(r)


@pytest.mark.parametrize("change,key", [
    ({"cluster": {"inference_gpus": 2, "gpus_per_engine": 2}, "model": {"hf_config": None,
      "path": "/m"}, "engine": {"backend": "sglang"}}, "cluster.gpus_per_engine"),
    ({"rollout": {"temperature": 0.7}}, "rollout.temperature"),
    ({"rollout": {"top_p": 0.9}}, "rollout.top_p"),
    ({"rollout": {"top_k": 20}}, "rollout.top_k"),
    ({"train": {"use_rollout_logprobs": True}}, "train.use_rollout_logprobs"),
    ({"train": {"global_batch_size": 8}}, "train.global_batch_size"),
    ({"sglang": {"speculative_algorithm": "EAGLE"}}, "sglang.speculative_algorithm"),
    ({"sglang": {"disaggregation_mode": "prefill"}}, "sglang.disaggregation_mode"),
    ({"engine": {"fault_tolerance": True}}, "engine.fault_tolerance"),
])
def test_mixed_policy_refresh_constraints(change, key):
    data = {"model": dict(MODEL), "async": {}, "refresh": {"mode": "mixed_policy"},
            "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 4}}
    assert validate(resolve(data)).ok
    for section, values in change.items():
        data.setdefault(section, {}).update(values)
    r = validate(resolve(data))
    assert any(key in e and "mixed_policy" in e for e in r.errors), r.errors


def test_async_requires_tis():
    r = report(train={"use_tis": False})
    assert any("train.use_tis" in e for e in r.errors)
    assert report(run={"profile": "dev"}, train={"use_tis": False}).ok


def test_trainers_and_engines_on_the_same_kind_of_device():
    r = report(cluster={"trainer_gpus": 1, "trainer_workers": 1})
    assert any("cluster.trainer_gpus = 1" in e and "cluster.inference_gpus = 0" in e
               for e in r.errors)


MEGATRON_GPU = dict(cluster={"trainer_gpus": 8, "trainer_workers": 8, "inference_gpus": 8},
                    engine={"backend": "embedded"})


def test_trainer_workers_must_tile_tensor_x_pipeline_parallel():
    r = report(**MEGATRON_GPU, train={"backend": "megatron", "tensor_parallel": 3,
                                      "pipeline_parallel": 1})
    assert ("cluster.trainer_workers = 8 must be a multiple of train.tensor_parallel x "
            "train.pipeline_parallel = 3 x 1 = 3") in r.errors
    r = report(**MEGATRON_GPU, train={"backend": "megatron", "tensor_parallel": 2,
                                      "pipeline_parallel": 2, "global_batch_size": 32,
                                      "micro_batch_size": 4},
               rollout={"rollout_batch_size": 8, "n_samples_per_prompt": 4})
    assert not [e for e in r.errors if "train." in e], r.errors
    r = report(train={"tensor_parallel": 2})
    assert any("model parallelism needs train.backend = 'megatron'" in e for e in r.errors)


def test_every_data_parallel_rank_gets_whole_groups():
    # TP2 x PP2 on 8 workers: DP = 2; 3 groups cannot be split evenly.
    r = report(**MEGATRON_GPU, train={"backend": "megatron", "tensor_parallel": 2,
                                      "pipeline_parallel": 2, "micro_batch_size": 1},
               rollout={"rollout_batch_size": 3, "n_samples_per_prompt": 4})
    assert any(e.startswith("rollout.rollout_batch_size = 3 groups must be a multiple of the 2 "
                            "data-parallel trainer ranks") for e in r.errors), r.errors
    r = report(**MEGATRON_GPU, train={"backend": "megatron", "tensor_parallel": 2,
                                      "micro_batch_size": 4},
               rollout={"rollout_batch_size": 4, "n_samples_per_prompt": 2})
    # DP = 4: a step of 8 samples is 2 per rank, fewer than one micro-batch of 4.
    assert ("train.global_batch_size = 8 must be a multiple of 4 data-parallel ranks x "
            "train.micro_batch_size = 4") in r.errors
    # torch DDP: every worker is a data-parallel rank.
    r = report(cluster={"trainer_workers": 3},
               rollout={"rollout_batch_size": 6, "n_samples_per_prompt": 2})
    assert not [e for e in r.errors if "rollout_batch_size" in e]
    r = report(cluster={"trainer_workers": 4},
               rollout={"rollout_batch_size": 6, "n_samples_per_prompt": 2})
    assert any("rollout.rollout_batch_size = 6 groups must be a multiple of the 4" in e
               for e in r.errors)


def test_sglang_speculative_and_disaggregation_keys():
    r = report(sglang={"speculative_algorithm": "NGRAM"})
    assert any("sglang.speculative_algorithm = 'NGRAM' needs engine.backend = 'sglang'" in e
               for e in r.errors)
    r = report(sglang={"disaggregation_mode": "prefill"})
    assert any(e.startswith("sglang.disaggregation_mode = 'prefill': prefill/decode") for e in r.errors)
