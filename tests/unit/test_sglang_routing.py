"""Routed experts through the SGLang client (MoE routing replay, rl_async/engine/sglang_routing.py):
launch flag and request field only when replay is on, and replies built in SGLang 0.5.23's
wire format parsed into RoutedExperts over the MoE layers, or refused with an EngineError
naming the request and the field."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from rl_async.engine import sglang_protocol as proto
from rl_async.engine.base import EngineError, SamplingParams
from rl_async.engine.sglang_args import SGLangEngineConfig, build_server_args
from rl_async.engine.sglang_routing import RoutingLayout, parse_routed_experts, routing_layout
from test_sglang_engine import _gen_reply, run_with_server

# DeepSeek-V3's layout in small: layer 0 dense (first_k_dense_replace), layers 1..3 MoE.
DEEPSEEK = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 1,
            "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
            "n_shared_experts": 1}
LAYOUT = routing_layout("auto", DEEPSEEK, "test")


def sglang_routes(positions: int, layout: RoutingLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    """Routes as SGLang's capturer holds them: int32 [positions, num_hidden_layers, top_k],
    distinct experts per token in MoE layers, dense layers never written (0)."""
    g = torch.Generator().manual_seed(seed)
    routes = torch.zeros(positions, layout.hidden_layers, layout.top_k, dtype=torch.int32)
    for layer in layout.moe_layers:
        for p in range(positions):
            routes[p, layer] = torch.randperm(layout.experts, generator=g)[:layout.top_k]
    return routes


def sglang_encode(routes: torch.Tensor) -> str:
    """DetokenizerManager._b64_encode_per_request (0.5.23):
    pybase64.b64encode(item.numpy().tobytes()).decode("utf-8"); pybase64 is base64's
    standard alphabet with padding, byte for byte."""
    return base64.b64encode(routes.numpy().tobytes()).decode("utf-8")


def reply_with_routes(prompt_len: int, output_ids: list[int], routes: torch.Tensor | None,
                      finish: str = "length") -> dict:
    meta = {"id": "r", "finish_reason": {"type": finish}, "prompt_tokens": prompt_len,
            "completion_tokens": len(output_ids), "weight_version": "3",
            "output_token_logprobs": [[-0.5, t, None] for t in output_ids]}
    if routes is not None:
        meta["routed_experts"] = sglang_encode(routes)
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


def test_layout_from_configs():
    assert LAYOUT == RoutingLayout(hidden_layers=4, top_k=2, experts=16, moe_layers=(1, 2, 3))
    qwen3 = {"num_hidden_layers": 6, "num_experts": 300, "num_experts_per_tok": 4,
             "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    layout = routing_layout("r3", qwen3, "test")
    assert layout.moe_layers == (1, 5) and layout.itemsize == 2
    dense = {"num_hidden_layers": 2, "intermediate_size": 8}
    assert routing_layout("auto", dense, "test") is None
    assert routing_layout("off", DEEPSEEK, "test") is None
    assert routing_layout("off", None, "unreadable") is None


@pytest.mark.parametrize("setting, config, needle", [
    ("r3", {"num_hidden_layers": 2}, "has no experts"),
    ("auto", None, "/ckpt/config.json is not readable"),
    ("auto", {"num_experts": 8, "num_experts_per_tok": 2}, "no num_hidden_layers"),
])
def test_layout_errors_name_the_key(setting, config, needle):
    with pytest.raises(ValueError) as info:
        routing_layout(setting, config, "/ckpt/config.json is not readable here")
    assert "train.routing_replay" in str(info.value) and needle in str(info.value)


def test_launch_flag_only_when_on():
    off = SGLangEngineConfig(model_path="/ckpt")
    on = SGLangEngineConfig(model_path="/ckpt", routed_experts=LAYOUT)
    assert "--enable-return-routed-experts" not in build_server_args(off, 1)
    assert build_server_args(on, 1)[-1] == "--enable-return-routed-experts"
    with pytest.raises(ValueError, match="train.routing_replay"):
        SGLangEngineConfig(model_path="/ckpt",
                           server_args={"enable-return-routed-experts": True})
    # a bare flag of 0.5.23 (extracted from its arg_groups; the fake server parses by it)
    flags = Path(__file__).parent / "fixtures" / "sglang_0_5_23" / "launch_flags.json"
    assert json.loads(flags.read_text())["--enable-return-routed-experts"] == "flag"


def test_request_field_only_when_on():
    params = SamplingParams(max_new_tokens=2)
    assert "return_routed_experts" not in proto.generate_payload([1, 2], params, "r")
    on = proto.generate_payload([1, 2], params, "r", return_routed_experts=True)
    assert on["return_routed_experts"] is True


def test_sglang_wire_format_parses_to_the_moe_layers():
    prompt_len, output_ids = 5, [7, 8, 9]
    routes = sglang_routes(prompt_len + len(output_ids) - 1)
    out = proto.parse_generate_response(reply_with_routes(prompt_len, output_ids, routes), "r",
                                        start_version=3, prompt_len=prompt_len, routing=LAYOUT)
    re = out.routed_experts
    assert (re.positions, re.layers, re.k, re.itemsize) == (7, 3, 2, 1)
    assert re.rows() == routes[:, 1:, :].tolist()  # the dense layer 0 dropped


def test_more_than_256_experts_are_uint16():
    layout = RoutingLayout(hidden_layers=2, top_k=2, experts=300, moe_layers=(0, 1))
    routes = sglang_routes(3, layout)
    routes[0, 0] = torch.tensor([299, 256], dtype=torch.int32)
    re = parse_routed_experts({"routed_experts": sglang_encode(routes)}, layout, 2, 2, "here")
    assert re.itemsize == 2 and re.rows() == routes.tolist()


def _set(routes: torch.Tensor, index: tuple, value: int) -> torch.Tensor:
    routes = routes.clone()
    routes[index] = value
    return routes


@pytest.mark.parametrize("mutate, needle", [
    (lambda m, r: m.pop("routed_experts"), "--enable-return-routed-experts"),
    (lambda m, r: m.__setitem__("routed_experts", [1, 2]), "expected a base64 string"),
    (lambda m, r: m.__setitem__("routed_experts", "not base64!"), "is not base64"),
    # prompt + output rows (one too many): not what 0.5.23 sends
    (lambda m, r: m.__setitem__("routed_experts", sglang_encode(
        torch.cat([r, r[:1]]))), "expected 7 positions (prompt 5 + output 3 - 1)"),
    (lambda m, r: m.__setitem__("routed_experts", sglang_encode(r[:, :, :1])),
     "expected 7 positions"),
    (lambda m, r: m.__setitem__("routed_experts", sglang_encode(_set(r, (3, 2, 0), 16))),
     "outside 0..15"),
    (lambda m, r: m.__setitem__("routed_experts", sglang_encode(
        r.index_fill(1, torch.tensor([0]), 3))), "routes layers [0]"),
    (lambda m, r: m.__setitem__("routed_experts", sglang_encode(
        r.index_fill(1, torch.tensor([2]), 0))), "routes layers [2]"),
])
def test_malformed_routes_raise_naming_request_and_field(mutate, needle):
    routes = sglang_routes(7)
    reply = reply_with_routes(5, [7, 8, 9], routes)
    mutate(reply["meta_info"], routes)
    with pytest.raises(EngineError) as info:
        proto.parse_generate_response(reply, "rid-7", 3, prompt_len=5, routing=LAYOUT)
    text = str(info.value)
    assert needle in text and "rid-7" in text and "meta_info.routed_experts" in text


def test_abort_and_off_carry_no_routes():
    aborted = reply_with_routes(5, [7], None, finish="abort")
    out = proto.parse_generate_response(aborted, "r", 3, prompt_len=5, routing=LAYOUT)
    assert out.finish_reason == "abort" and out.routed_experts is None
    finished = reply_with_routes(5, [7, 8, 9], sglang_routes(7))
    assert proto.parse_generate_response(finished, "r", 3, prompt_len=5).routed_experts is None


def test_engine_asks_and_parses_over_http():
    def reply(body):
        out = _gen_reply(body)
        n = len(body["input_ids"]) + len(out["output_ids"]) - 1
        if body.get("return_routed_experts"):
            out["meta_info"]["routed_experts"] = sglang_encode(sglang_routes(n, seed=n))
        return 200, out

    async def test(engine, fake):
        fake.replies["/generate"] = reply
        out = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
        assert fake.calls("/generate")[0]["return_routed_experts"] is True
        assert out.routed_experts.rows() == sglang_routes(4, seed=4)[:, 1:].tolist()

    run_with_server(test, routed_experts=LAYOUT)
