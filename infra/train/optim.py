"""The optimizer every trainer engine uses, in a leaf module that the engines import.

One builder so the torch, FSDP and DeepSpeed engines (and the supervised warm start that runs on
them) step with the same AdamW: a plain torch optimizer, so no compiled DeepSpeed op (FusedAdam,
CPUAdam) is needed, also with ZeRO-Offload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from infra.config import TrainerConfig

ADAM_BETAS: tuple[float, float] = (0.9, 0.99)


def make_optimizer(params: Any, tcfg: "TrainerConfig") -> "torch.optim.Optimizer":
    """AdamW over ``params`` with the trainer's learning rate and weight decay, betas :data:`ADAM_BETAS`."""
    import torch

    return torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, betas=ADAM_BETAS)


def set_lr(optimizer: "torch.optim.Optimizer", lr: float) -> None:
    """Set the learning rate of every parameter group (the schedule is applied per step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
