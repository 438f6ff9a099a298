"""Trainer ranks as processes of a test: start them (spawn), join them into a gloo group through a
rendezvous file (no port to race for), and read what they put on a queue, failing fast when one dies."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def join_gloo(rank: int, world: int, rendezvous: str) -> None:
    """In a rank's process: one torch thread, and the gloo group of ``world`` ranks met at ``rendezvous``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))


def run_ranks(target: Callable[..., None], world: int, args: Callable[[int, Any], tuple], count: int,
              timeout_s: float) -> list[tuple]:
    """Start ``world`` processes ``target(*args(rank, queue))``, read ``count`` messages from their
    queue, wait for them to exit and check that they all exited 0. Fails as soon as a rank dies or
    ``timeout_s`` passes without the messages."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=args(r, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: list[tuple] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        try:
            got.append(q.get(timeout=2))
        except queue.Empty:
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "a rank died or hung"
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}"
    return got
