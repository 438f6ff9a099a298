"""A trainer rank that builds a small model in one engine, takes an optimizer step and reports
what each way of reading its parameters gives (for tests that run several ranks in processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.rank_helpers import join_gloo

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


class Uneven(torch.nn.Module):
    """Rows that do not split evenly over two ranks (7, 3, 11, 1), a rank with no rows of a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)])
        self.head = torch.nn.Linear(3, 11, bias=False)
        self.one = torch.nn.Parameter(torch.randn(1, 11))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = torch.tanh(layer(x))
        return self.head(x) * self.one


def engine_rank(rank: int, world: int, rendezvous: str, overrides: list[str], q: Any) -> None:
    """Build :class:`Uneven` in the engine ``overrides`` choose, step it twice, and put
    ``(rank, full_params on rank 0 as bf16, owned_params of this rank as bf16)`` on ``q`` (bf16 bit
    patterns as int16 arrays), with the parameters dealt to the ranks round-robin. The ranks meet
    through the file ``rendezvous``."""
    import torch.distributed as dist

    from infra.config import load_config
    from infra.process_env import set_defaults
    from infra.train.engines import create_engine

    import os

    set_defaults()
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world)})  # as torchrun
    join_gloo(rank, world, rendezvous)
    try:
        tcfg = load_config(DEMO, overrides).trainer
        torch.manual_seed(3)
        engine = create_engine(Uneven(), tcfg, world, rank)
        for step in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + rank))
            x = x.to(next(engine.module.parameters()).dtype)  # DeepSpeed bf16 casts the module itself
            with engine.autocast():
                loss = engine.module(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        names = list(engine.param_numels())
        owner = {n: i % world for i, n in enumerate(names)}
        full = engine.full_params()
        mine = engine.owned_params(owner.__getitem__)

        def bf16(d: dict | None) -> dict | None:  # as numpy bit patterns: a queue pickles them by value
            return None if d is None else {n: t.detach().cpu().to(torch.bfloat16).view(torch.int16).numpy().copy()
                                           for n, t in d.items()}

        q.put((rank, bf16(full), bf16(mine), owner))
    finally:
        dist.destroy_process_group()
