"""The GPU check of trainer rank 0's publication sender (scripts/gpu_checks.py runs it).

What one GPU can show of the publication path (rl_async/state/sender.py, collective.py):
the snapshot is staged from device weights into pinned host memory (GPU trainers never keep
a model copy on the GPU), sent over a real NCCL channel created the way the fleet creates
them (a store on an ephemeral port bound once, `init_custom_process_group`), with rl-async's
NCCL environment; while sending, GPU memory grows by one bucket, not by a model; destroying
the channel (an NCCL abort) returns at once. A channel here has one rank: NCCL refuses two
ranks on one GPU, so a trainer-to-engine transfer over NCCL needs two GPUs (docs/gpu.md).
"""

from __future__ import annotations

import os
import time

import torch


def check_publication_channel(device: str) -> dict:
    from rl_async.state import collective
    from rl_async.state.sender import PublicationSender
    from rl_async.state.weights import unflatten_bucket, weights_checksum

    os.environ.update(collective.OWN_PROCESS_NCCL_ENV)  # read when NCCL initialises
    backend = "nccl" if device == "cuda" else "gloo"
    gen = torch.Generator().manual_seed(5)
    weights = [(f"layers.{i}.weight", torch.randn(1024, 2048, generator=gen).to(device))
               for i in range(24)]  # 200 MB in fp32, 100 MB as bf16
    want = weights_checksum((n, t.to(torch.bfloat16)) for n, t in weights)
    bucket_bytes = 16 << 20
    sender = PublicationSender(backend, device)
    name = "gpu-check/pub/engine-0/n0/g1"
    sender.open_channel(name, 60)
    sender.join_channel(name, 1)
    metas = sender.stage(iter(weights), torch.bfloat16, bucket_bytes, flat=False,
                         checksum=True)
    snap = sender.staged
    if snap.checksum != want:
        raise AssertionError("the staged snapshot is not the weights in bf16")
    host = {b.device.type for b in snap.buckets}
    pinned = all(b.is_pinned() for b in snap.buckets) if device == "cuda" else None
    if host != {"cpu"} or pinned is False:
        raise AssertionError(f"snapshot buckets on {host}, pinned {pinned}: GPU trainers must "
                             f"keep it in pinned host memory")
    base = peak = 0
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    nbytes, failed = sender.send([name], "staged", 60)
    send_s = time.monotonic() - started
    if failed:
        raise AssertionError(f"the channel failed: {failed}")
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        # the device buffer is the largest bucket; NCCL's own buffers are not counted here
        largest = max(m[3] for m in metas)
        if peak > largest + (4 << 20):
            raise AssertionError(f"sending grew GPU memory by {peak / 2**20:.0f} MiB; one "
                                 f"bucket is {largest / 2**20:.0f} MiB")
        on_device = sender._on_device(snap.buckets[-1])
        back = unflatten_bucket(on_device.cpu(), *metas[-1][:3])
        if weights_checksum(back) != weights_checksum(
                unflatten_bucket(snap.buckets[-1], *metas[-1][:3])):
            raise AssertionError("the host -> device copy of a bucket changed its bytes")
    started = time.monotonic()
    sender.close_channel(name)
    close_s = time.monotonic() - started
    if close_s > 10:
        raise AssertionError(f"destroying the channel took {close_s:.1f} s")
    return {"backend": backend, "bytes": nbytes, "buckets": len(metas),
            "send_seconds": round(send_s, 3), "close_seconds": round(close_s, 3),
            "send_peak_mib": round(peak / 2**20, 1), "host_pinned": pinned,
            "env": {k: os.environ.get(k) for k in collective.OWN_PROCESS_NCCL_ENV}}


def _receiver(port: int, name: str, metas, device: str, mode: str, results) -> None:
    """An engine's end of one channel, in its own process (cuda:1 over NCCL, or the CPU over
    gloo): receive every flat bucket and report a checksum, or die after the first one."""
    import os

    import torch.distributed as dist

    from rl_async.state import collective
    from rl_async.state.weights import unflatten_bucket, weights_checksum

    os.environ.update(collective.OWN_PROCESS_NCCL_ENV)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    group = collective.init_custom_process_group(backend, f"tcp://127.0.0.1:{port}", 2, 1,
                                                 name, timeout=30)
    named = []
    for k, (names, dtypes, shapes, nbytes) in enumerate(metas):
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dist.broadcast(flat, group=group, group_src=0)
        if backend == "nccl":
            torch.cuda.synchronize()
        if mode == "die" and k == 0:
            os._exit(1)
        named += [(n, t.cpu().clone()) for n, t in unflatten_bucket(flat, names, dtypes, shapes)]
    results.put(weights_checksum(named))


def check_publication_two_ranks(device: str) -> dict:
    """Trainer rank 0 (this process) and an engine in another process, over one channel:
    the snapshot arrives bit-exact; then an engine that dies after the first bucket costs
    its channel (reported within publication.channel_timeout_s, the sender's process
    unharmed) and nothing else. NCCL needs two GPUs (it refuses two ranks on one device);
    --cpu runs the same code over gloo."""
    import multiprocessing
    import threading

    from gpu_check_train import Skip

    from rl_async.state import collective
    from rl_async.state.sender import PublicationSender

    if device == "cuda" and torch.cuda.device_count() < 2:
        raise Skip("needs two GPUs: NCCL refuses two ranks on one device (the --cpu variant "
                   "runs this over gloo)")
    os.environ.update(collective.OWN_PROCESS_NCCL_ENV)
    backend, peer = ("nccl", "cuda:1") if device == "cuda" else ("gloo", "cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(9)
    weights = [(f"w{i}", torch.randn(256, 512, generator=gen).to(device)) for i in range(8)]
    ctx = multiprocessing.get_context("spawn")
    out: dict = {"backend": backend}
    for mode in ("ok", "die"):
        sender = PublicationSender(backend, device)
        metas = sender.stage(iter(weights), torch.bfloat16, 1 << 20, flat=True, checksum=True)
        name = f"two-ranks-{mode}"
        results = ctx.Queue()
        port = sender.open_channel(name, 30)
        proc = ctx.Process(target=_receiver, args=(port, name, metas, peer, mode, results))
        proc.start()
        join = threading.Thread(target=sender.join_channel, args=(name, 2))
        join.start()
        join.join(60)
        started = time.monotonic()
        nbytes, failed = sender.send([name], "staged", 10.0)
        out[f"{mode}_send_seconds"] = round(time.monotonic() - started, 3)
        if mode == "ok":
            got = results.get(timeout=60)
            if failed or got != sender.staged.checksum:
                raise AssertionError(f"the engine's weights differ from the snapshot ({failed})")
            out["bytes"] = nbytes
            sender.close_channel(name)
        elif name not in failed:
            raise AssertionError("an engine that died mid-transfer was not reported")
        else:
            out["dead_engine_reported"] = failed[name][:200]
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def check_sglang_stop_rule(device: str) -> dict:
    """Where SGLang is installed: a live server stops a greedy response at a stop id
    (finish_reason "stop", the stop id last). SGLang checks stop ids only when ignore_eos is
    false (Req.check_finished): the bug that ran every rollout to max_response_len."""
    import asyncio
    import importlib.util
    import tempfile

    from gpu_check_train import Skip

    try:
        installed = importlib.util.find_spec("sglang") is not None
    except ImportError:  # an import hook that refuses it counts as absent
        installed = False
    if not installed:
        raise Skip("needs SGLang, not installed here: tests/gpu/test_sglang_gpu.py runs this "
                   "rule against a live server where it is, and tests/unit/"
                   "test_sglang_rules.py against a double written from SGLang's source")
    if device != "cuda":
        raise Skip("SGLang serves on a GPU")
    from rl_async.engine.base import SamplingParams
    from rl_async.engine.sglang_engine import SGLangEngine, SGLangEngineConfig
    from rl_async.state.models import build_causal_lm, tiny_llama_config

    with tempfile.TemporaryDirectory() as model_dir:
        build_causal_lm(tiny_llama_config(vocab_size=512, max_position_embeddings=512),
                        dtype="bfloat16").save_pretrained(model_dir)

        async def main():
            engine = SGLangEngine(SGLangEngineConfig(
                model_path=model_dir, gpu_ids=(0,), port=0, mem_fraction_static=0.3,
                startup_timeout_s=300, server_args={"skip_tokenizer_init": True,
                                                    "dtype": "bfloat16"}))
            await engine.start()
            try:
                first = await engine.generate([1, 17, 42], SamplingParams(
                    max_new_tokens=8, temperature=0.0))
                stop = first.output_ids[0]
                stopped = await engine.generate([1, 17, 42], SamplingParams(
                    max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,)))
            finally:
                await engine.shutdown()
            if stopped.output_ids != [stop] or stopped.finish_reason != "stop":
                raise AssertionError(f"stop id {stop}: got {stopped.output_ids} "
                                     f"({stopped.finish_reason})")
            return {"stop_id": stop, "first_response": first.output_ids,
                    "finish_reason": stopped.finish_reason}

        return asyncio.run(main())
