"""Every trainer engine's ``owned_params`` (what each rank publishes: read in place on replicas and
ZeRO-1/2, all-gathered and kept by its owner under FSDP and ZeRO-3) holds, bit for bit in bf16, what
the full-precision ``full_params`` gather to rank 0 does, after real optimizer steps, on two gloo
ranks, with shards that do not split evenly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.engine_helpers import engine_rank
from tests.rank_helpers import run_ranks

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
    rendezvous = str(tmp_path / "rendezvous")
    got = {rank: (full, mine, owner) for rank, full, mine, owner in
           run_ranks(engine_rank, 2, lambda r, q: (r, 2, rendezvous, ENGINES[engine], q), 2, 300)}
    full, _, owner = got[0]
    assert full is not None and got[1][0] is None and len(full) == 6
    for rank in (0, 1):
        mine = got[rank][1]
        assert sorted(mine) == sorted(n for n, o in owner.items() if o == rank) and mine
        for name, bits in mine.items():
            assert bits.shape == full[name].shape and np.array_equal(bits, full[name]), (rank, name)
