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
