"""Contract tests against SGLang's own code (pinned 0.5.23): our launch argv must parse with
SGLang's ServerArgs CLI parser, and every request payload must construct SGLang's own request
classes (unknown or missing fields fail) and pass the validation its HTTP server applies.
Skipped where sglang is not installed (it needs a CUDA stack)."""

from __future__ import annotations

import argparse
import sys

import pytest

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang", reason="sglang is not installed")

from pydantic import TypeAdapter  # noqa: E402
from sglang.api.v1.api_types import GenerateRequest, GenerateResponse  # noqa: E402
from sglang.srt.managers import io_struct  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from rl_async.engine import sglang_protocol as proto  # noqa: E402
from rl_async.engine.base import SamplingParams  # noqa: E402
from rl_async.engine.sglang_args import SGLANG_VERSION, SGLangEngineConfig, \
    build_server_args  # noqa: E402


def test_installed_version_is_the_pinned_one():
    assert sglang.__version__ == SGLANG_VERSION


def test_launch_args_parse_with_sglang_server_args():
    config = SGLangEngineConfig(model_path="/ckpt/tiny", gpus_per_engine=2,
                                mem_fraction_static=0.6, max_running_requests=32,
                                initial_weight_version=3, speculative_algorithm="NGRAM",
                                disaggregation_mode="decode",
                                server_args={"dtype": "bfloat16", "skip_server_warmup": True,
                                             "random_seed": 7})
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(build_server_args(config, 31234))
    assert (ns.model_path, ns.tp_size, ns.host, ns.port) == ("/ckpt/tiny", 2, "127.0.0.1", 31234)
    assert (ns.mem_fraction_static, ns.max_running_requests) == (0.6, 32)
    assert ns.weight_version == "3" and ns.dtype == "bfloat16"
    assert ns.skip_server_warmup is True and ns.random_seed == 7
    assert ns.speculative_algorithm == "NGRAM" and ns.disaggregation_mode == "decode"


def _payloads() -> list[tuple[str, dict]]:
    return [
        ("AbortReq", proto.abort_payload("r1")),
        ("AbortReq", proto.abort_payload(None)),
        *[("PauseGenerationReqInput", proto.pause_payload(m)) for m in
          ("abort", "retract", "in_place")],
        ("ContinueGenerationReqInput", {}),
        ("BeginWeightUpdateReqInput", {}),
        ("EndWeightUpdateReqInput", {}),
        ("InitWeightsUpdateGroupReqInput",
         proto.init_group_payload("10.0.0.1", 29500, 1, 3, "pub", "nccl")),
        ("UpdateWeightsFromDistributedReqInput",
         proto.update_distributed_payload(["w"], ["torch.bfloat16"], [[4, 4]], "pub", 5, True,
                                          "flattened_bucket")),
        ("UpdateWeightsFromDistributedReqInput",
         proto.update_distributed_payload(["w"], ["float32"], [[4]], "pub", None, False)),
        ("UpdateWeightsFromTensorReqInput",
         proto.update_tensor_payload([b"rank0"], 2, True, "flattened_bucket")),
    ]


@pytest.mark.parametrize("cls_name, payload", _payloads())
def test_control_payloads_construct_sglang_request_classes(cls_name, payload):
    cls = getattr(io_struct, cls_name)
    # The HTTP server validates bodies through pydantic (FastAPI); the same adapter here.
    adapter = TypeAdapter(cls)
    obj = adapter.validate_python(payload)
    for key, value in payload.items():
        if key != "serialized_named_tensors":
            assert getattr(obj, key) == value
    # pydantic ignores unknown keys; keyword construction does not: unknown or missing
    # fields are a TypeError.
    cls(**payload)


def test_an_unknown_field_is_caught():
    with pytest.raises(TypeError):
        io_struct.InitWeightsUpdateGroupReqInput(
            **proto.init_group_payload("h", 1, 1, 2, "g", "nccl"), rank=1)


def test_generate_payload_passes_sglang_generate_contract():
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=-1,
                            stop_token_ids=(2,), seed=5)
    payload = proto.generate_payload([1, 2, 3], params, "rid-1")
    GenerateRequest.from_json_value(payload)  # the /generate contract gate of the server
    obj = io_struct.GenerateReqInput(**payload)
    assert obj.rid == "rid-1" and obj.return_logprob is True
    # The scheduler builds its SamplingParams from the dict and verifies it.
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    SGLangSamplingParams(**payload["sampling_params"]).verify(vocab_size=32000)


def test_routed_experts_flag_request_and_reply_match_sglang():
    """Routing replay: the flag sets ServerArgs.enable_return_routed_experts, the request
    field is GenerateReqInput's, and a reply encoded by SGLang's own detokenizer parses."""
    import torch
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    from rl_async.engine.sglang_routing import RoutingLayout

    layout = RoutingLayout(hidden_layers=3, top_k=2, experts=8, moe_layers=(1, 2))
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    on = SGLangEngineConfig(model_path="/ckpt/tiny", routed_experts=layout)
    assert parser.parse_args(build_server_args(on, 1)).enable_return_routed_experts is True
    off = SGLangEngineConfig(model_path="/ckpt/tiny")
    assert parser.parse_args(build_server_args(off, 1)).enable_return_routed_experts is False

    payload = proto.generate_payload([1, 2, 3], SamplingParams(max_new_tokens=2), "rid-r",
                                     return_routed_experts=True)
    GenerateRequest.from_json_value(payload)
    assert io_struct.GenerateReqInput(**payload).return_routed_experts is True

    routes = torch.zeros(3 + 2 - 1, 3, 2, dtype=torch.int32)  # prompt + output - 1 rows
    routes[:, 1:, 0], routes[:, 1:, 1] = 5, 7
    [encoded] = DetokenizerManager._b64_encode_per_request([routes])
    reply = {"text": "", "output_ids": [4, 5],
             "meta_info": {"id": "rid-r", "finish_reason": {"type": "length", "length": 2},
                           "prompt_tokens": 3, "completion_tokens": 2,
                           "output_token_logprobs": [[-0.1, 4, None], [-0.2, 5, None]],
                           "weight_version": "1", "routed_experts": encoded}}
    assert extract_routed_experts_from_meta_info(reply).tolist() == routes.flatten().tolist()
    out = proto.parse_generate_response(reply, "rid-r", 1, prompt_len=3, routing=layout)
    assert out.routed_experts.rows() == routes[:, 1:].tolist()


def test_parser_accepts_replies_in_sglang_response_schema():
    reply = {
        "text": "", "output_ids": [5, 6],
        "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 6},
                      "prompt_tokens": 3, "completion_tokens": 2,
                      "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
                      "weight_version": "4",
                      "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                          {"version": "4", "start": 1, "end": 2}]},
    }
    # Round trip through SGLang's own response type, then our parser.
    canonical = GenerateResponse.from_json_value(reply).to_json_value()
    out = proto.parse_generate_response(canonical, "r", start_version=3)
    assert out.output_ids == [5, 6] and out.token_versions == [3, 4]
    assert out.finish_reason == "stop" and out.output_logprobs == [-0.1, -0.2]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
