"""Training engines: how the trainer ranks share one optimisation step (``trainer.engine``).

Every engine exposes the same small surface to :mod:`infra.train.worker` — a module to run forward on,
``backward``/``step`` (gradient accumulation = several ``backward`` calls, then one ``step``), the
learning rate, the *full* fp32 parameters on rank 0 (for publishing and export), and a per-rank
``save``/``load`` of the complete optimisation state into a local folder (which
:mod:`infra.train.checkpoint` moves to and from the object store, once their digests verify). Engine
files are torch files read back with ``weights_only=True`` (tensors and plain containers, no code).

- ``torch``: every rank holds a full replica and its AdamW state; gradients are averaged with one flat
  all-reduce (what DDP does, without its bucketing hooks, so any number of ``backward`` calls
  accumulate locally and the reduction happens once per ``step``).
- ``fsdp``: :mod:`infra.train.fsdp` (torch FullyShardedDataParallel).
- ``deepspeed``: :mod:`infra.train.ds` (ZeRO 1/2/3, CPU offload, bf16).

Gradients are *averaged* over ranks by every engine; the GRPO loss is normalised accordingly (see
:mod:`infra.train.grpo`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from infra.backends import Registry
from infra.train.optim import make_optimizer, set_lr

if TYPE_CHECKING:
    import torch

    from infra.config import TrainerConfig


class TrainEngine(Protocol):
    """What the worker needs from an engine."""

    module: "torch.nn.Module"

    def autocast(self) -> contextlib.AbstractContextManager: ...
    def set_lr(self, lr: float) -> None: ...
    def backward(self, loss: "torch.Tensor") -> None: ...
    def step(self) -> float: ...
    def reset_optimizer(self) -> None: ...
    def full_params(self) -> "dict[str, torch.Tensor] | None":
        """Collective: every parameter whole, at full precision (fp32 masters), on rank 0 (None elsewhere)."""
        ...

    def owned_params(self, owner: "Callable[[str], int]") -> "dict[str, torch.Tensor]":
        """Collective: the parameters whose ``owner(name)`` is this rank, whole (empty elsewhere), for
        publishing in bf16: exact to bf16 at least. Replicas and ZeRO-1/2 read them in place (no
        collective); sharded engines all-gather each one and its owner keeps it."""
        ...

    def param_numels(self) -> dict[str, int]:
        """Every parameter's name and whole element count, in module order (no communication)."""
        ...
    def save(self, folder: Path) -> None: ...
    def load(self, folder: Path) -> None: ...


class TorchEngine:
    """Full replica per rank; one flat all-reduce of the gradients per step (DDP semantics)."""

    def __init__(self, model: "torch.nn.Module", tcfg: "TrainerConfig", world: int, rank: int) -> None:
        self.module = model
        self.world, self.rank = world, rank
        self.tcfg = tcfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params, tcfg)

    def autocast(self) -> contextlib.AbstractContextManager:
        import torch

        if not self.tcfg.bf16:
            return contextlib.nullcontext()
        dev = next(self.module.parameters()).device.type
        return torch.autocast(device_type=dev, dtype=torch.bfloat16)

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def backward(self, loss: "torch.Tensor") -> None:
        loss.backward()

    def step(self) -> float:
        import torch
        import torch.distributed as dist

        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            dist.all_reduce(flat)
            flat /= self.world
            offset = 0
            for p in self.params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.tcfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def reset_optimizer(self) -> None:
        self.optimizer.state.clear()

    def full_params(self) -> "dict[str, torch.Tensor] | None":
        if self.rank != 0:
            return None
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def owned_params(self, owner: "Callable[[str], int]") -> "dict[str, torch.Tensor]":
        return {n: p.detach() for n, p in self.module.named_parameters() if owner(n) == self.rank}  # replicas

    def param_numels(self) -> dict[str, int]:
        return {n: p.numel() for n, p in self.module.named_parameters()}

    def save(self, folder: Path) -> None:
        import torch

        if self.rank == 0:  # replicas are identical: one copy
            torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()},
                       folder / "replica.pt")

    def load(self, folder: Path) -> None:
        import torch

        state = torch.load(folder / "replica.pt", map_location="cpu", weights_only=True)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


#: ``trainer.engine`` -> engine class; FSDP and DeepSpeed are imported only when chosen.
ENGINES: Registry[TrainEngine] = Registry("trainer engine", {
    "torch": TorchEngine,
    "fsdp": "infra.train.fsdp:FSDPEngine",
    "deepspeed": "infra.train.ds:DeepSpeedEngine",
})


def create_engine(model: "torch.nn.Module", tcfg: "TrainerConfig", world: int, rank: int) -> TrainEngine:
    """Wrap ``model`` in the engine named by ``tcfg.engine``; unknown names raise ``ValueError``."""
    return ENGINES.create(tcfg.engine, model, tcfg, world, rank)
