"""A tiny distributed job launched by the cluster tests: ``python -m tests.integration.test_cluster_job``.

Under torchrun, every rank joins one gloo group, checks an all-reduce, and takes a few data-parallel
SGD steps on a small regression (gradients averaged by all-reduce). Rank 0 writes a JSON summary to
``--out``: world size, the hostname of every rank, the all-reduce result, the losses, and whether the
parameters are bit-identical on every rank. No tests are collected from this module.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    probe = torch.full((4,), float(rank + 1))
    dist.all_reduce(probe)

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data shard
    true_w = torch.arange(8, dtype=torch.float32) / 8
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 8, generator=gen)
        y = x @ true_w + 0.5
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(float(mean_loss) / world)

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    hosts: list[object] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if rank == 0:
        summary = {
            "world_size": world,
            "hostnames": hosts,
            "allreduce": probe.tolist(),
            "losses": losses,
            "params_equal": all(torch.equal(flat, g) for g in gathered),
            "master_addr": os.environ.get("MASTER_ADDR"),
        }
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(summary))
        tmp.rename(args.out)
    dist.barrier()
    # Leave without tearing the gloo group down: a rank that destroys it while its peer's last
    # collective is still settling can make the peer abort ("terminate called without an active
    # exception", SIGABRT, seen once in CI), which would fail a job whose work is complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
