"""Every trainer engine's ``owned_params`` (what each rank publishes: read in place on replicas and
ZeRO-1/2, all-gathered and kept by its owner under FSDP and ZeRO-3) holds, bit for bit in bf16, what
the full-precision ``full_params`` gather to rank 0 does, after real optimizer steps, on two gloo
ranks, with shards that do not split evenly."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from pathlib import Path

import numpy as np
import pytest

from tests.engine_helpers import engine_rank

pytestmark = pytest.mark.slow

ENGINES = {
    "torch": ["trainer.engine=torch"],
    "fsdp": ["trainer.engine=fsdp"],
    "fsdp-bf16": ["trainer.engine=fsdp", "trainer.bf16=true"],
    "zero2": ["trainer.engine=deepspeed", "trainer.zero_stage=2"],
    "zero2-bf16": ["trainer.engine=deepspeed", "trainer.zero_stage=2", "trainer.bf16=true"],
    "zero3": ["trainer.engine=deepspeed", "trainer.zero_stage=3"],
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_owned_params_are_the_full_params_in_bf16(engine: str, tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=engine_rank, args=(r, 2, str(tmp_path / "rendezvous"), ENGINES[engine], q),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 300
    while len(got) < len(procs):
        try:
            rank, full, mine, owner = q.get(timeout=2)
        except queue.Empty:
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "a rank died or hung"
            continue
        got[rank] = (full, mine, owner)
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    full, _, owner = got[0]
    assert full is not None and got[1][0] is None and len(full) == 6
    for rank in (0, 1):
        mine = got[rank][1]
        assert sorted(mine) == sorted(n for n, o in owner.items() if o == rank) and mine
        for name, bits in mine.items():
            assert bits.shape == full[name].shape and np.array_equal(bits, full[name]), (rank, name)
