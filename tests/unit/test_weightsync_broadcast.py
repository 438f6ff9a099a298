"""Broadcast transport with 2 real gloo processes: full first, deltas after, bit-exact, drift detected."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from infra.weightsync.testing import Drift, same


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from infra.weightsync import WrongBase
    from infra.weightsync.broadcast import BroadcastSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        sync = BroadcastSync(src=0, chunk_bytes=16 << 10)
        d = Drift()
        log = []
        have, hv = None, None
        for step in range(4):
            if rank == 0:
                info = sync.publish(d.bf16())
                log.append(info.kind)
            else:
                if step == 3:  # drift: claim the right version but hold the wrong bytes
                    bad = {k: v.clone() for k, v in have.items()}
                    bad["embed.weight"].view(torch.int16)[0, 0] ^= 1
                    try:
                        sync.fetch(bad, hv)
                        log.append("undetected")
                    except WrongBase as exc:
                        log.append("wrongbase" if exc.tensor == "embed.weight" else "wrong-tensor")
                else:
                    have, hv = sync.fetch(have, hv)
                    log.append("ok" if (hv == step + 1 and same(have, d.bf16())) else "mismatch")
            d.step()
        if rank == 0:  # after the failure rank 1 reports its old version -> full tensors next round
            log.append(sync.publish(d.bf16()).kind)
        else:
            got, v = sync.fetch(None, None)
            log.append("ok" if (v == 5 and same(got, d.bf16())) else "mismatch")
        Path(out_dir, f"rank{rank}.txt").write_text(",".join(log))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_broadcast_two_gloo_ranks(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(_port(), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "rank0.txt").read_text() == "keyframe,delta,delta,delta,keyframe"
    assert (tmp_path / "rank1.txt").read_text() == "ok,ok,ok,wrongbase,ok"
