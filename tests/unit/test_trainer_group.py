"""The trainers' default group (rl_async/train/distributed.py): rank 0 hosts the rendezvous
store on a port that is already bound when it is handed out (a probed free port was closed
and bound again, so another process could take it in between), and the backend comes from
cluster.trainer_gpus, not from whether CUDA is visible (CPU DDP trainers on a GPU node)."""

from __future__ import annotations

import multiprocessing
import socket

import torch


def _rank(rank: int, ports, results) -> None:
    import torch.distributed as dist

    from rl_async.train.distributed import host_store, init_distributed, trainer_backend

    torch.cuda.is_available = lambda: True  # a GPU node; these trainers hold no GPU
    store = None
    if rank == 0:
        store = host_store(60)
        with socket.socket() as probe:  # already bound: nobody can take it now
            try:
                probe.bind(("", store.port))
                results.put(("port_free", rank, store.port))
            except OSError:
                results.put(("port_bound", rank, store.port))
        ports.put(store.port)
        port = store.port
    else:
        port = ports.get(timeout=60)
    init_distributed("127.0.0.1", port, rank, 2, trainer_backend(0), timeout_s=60, store=store)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    results.put(("joined", rank, (dist.get_backend(), float(t))))
    dist.barrier()
    dist.destroy_process_group()


def test_cpu_trainers_join_rank_0s_store_over_gloo_on_a_node_with_cuda():
    ctx = multiprocessing.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(3)]
    for p in procs:
        p.join(60)
    assert [k for k, *_ in got].count("port_bound") == 1, got
    assert sorted(payload for k, _, payload in got if k == "joined") == [("gloo", 3.0)] * 2


def test_the_backend_is_the_clusters_not_cudas():
    from rl_async.train.distributed import trainer_backend

    assert trainer_backend(0) == "gloo" and trainer_backend(8) == "nccl"
