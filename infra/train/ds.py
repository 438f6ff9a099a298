"""DeepSpeed ZeRO as a trainer engine (``trainer.engine: deepspeed``).

:func:`ds_config` turns the ``trainer`` config section into a DeepSpeed config: ZeRO stage 1/2/3,
optional CPU offload of optimizer state (ZeRO-Offload) and of parameters (stage 3), bf16 with fp32
master weights, gradient clipping. Gradient accumulation is *unmanaged*
(``managed_gradient_accumulation: false``): the worker calls ``backward`` once per micro-batch and
``step`` once per update, and every ``step`` is the accumulation boundary, so the number of
micro-batches may change from step to step (rollout batches do).

The optimizer is a plain ``torch.optim.AdamW`` handed to ``deepspeed.initialize``: no JIT-compiled
op (FusedAdam, CPUAdam) is needed, also with offload (``zero_force_ds_cpu_optimizer: false``). On
the CPU accelerator DeepSpeed would also JIT-compile a shared-memory all-reduce at start-up; it is
skipped (gloo does the collectives) unless ``DELTALOOP_DS_SHM=1``.

Full parameters for publishing are assembled with ``safe_get_full_fp32_param`` (the fp32 master
copy; a collective under ZeRO-3, so every rank calls :meth:`DeepSpeedEngine.full_params`).
Checkpoints use DeepSpeed's own per-rank files (``save_checkpoint``/``load_checkpoint``), which hold
each rank's optimizer partition and fp32 master weights, so a restore is exact. DeepSpeed's loader
unpickles them with ``weights_only=False``; :mod:`infra.train.checkpoint` hands it only files whose
digests the run-secret-signed manifest vouches for, and :meth:`DeepSpeedEngine.load` also swaps the
loader for ``torch.load(weights_only=True)`` with the three DeepSpeed classes those files hold
(:data:`SAFE_GLOBALS`) allow-listed, so even a file that slipped past the digests cannot name any
other callable.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra.train.optim import make_optimizer, set_lr

if TYPE_CHECKING:
    import torch

    from infra.config import TrainerConfig

_TAG = "ckpt"

#: The only non-torch globals DeepSpeed's checkpoint files reference (ZeRO 0-3, bf16, offload).
SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def weights_only_load(path: str, map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)`` allowing just :data:`SAFE_GLOBALS` (no other code)."""
    import torch

    allowed = [getattr(importlib.import_module(mod), name) for mod, name in SAFE_GLOBALS]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location=map_location, weights_only=True)


def ds_config(tcfg: "TrainerConfig", world: int) -> dict[str, Any]:
    """The DeepSpeed config dict for ``tcfg`` on ``world`` ranks."""
    zero: dict[str, Any] = {"stage": tcfg.zero_stage, "overlap_comm": False, "contiguous_gradients": True}
    if tcfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if tcfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": tcfg.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": tcfg.micro_batch * world,
        "managed_gradient_accumulation": False,
        "gradient_clipping": tcfg.grad_clip,
        "bf16": {"enabled": tcfg.bf16},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _skip_cpu_shm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce (gloo is used instead)."""
    if os.environ.get("DELTALOOP_DS_SHM") == "1":
        return
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def wrap_deepspeed(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer", tcfg: "TrainerConfig",
                   world: int) -> tuple[Any, Any]:
    """``deepspeed.initialize`` on an existing process group; returns (engine, ZeRO optimizer)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")
    import deepspeed

    _skip_cpu_shm_op()
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(tcfg, world),
                                                dist_init_required=False)
    return engine, ds_opt


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class DeepSpeedEngine:
    """:class:`~infra.train.engines.TrainEngine` over a DeepSpeed ZeRO engine."""

    def __init__(self, model: "torch.nn.Module", tcfg: "TrainerConfig", world: int, rank: int) -> None:
        self.tcfg, self.world, self.rank = tcfg, world, rank
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], tcfg)
        self.engine, self.optimizer = wrap_deepspeed(model, opt, tcfg, world)
        self.module = self.engine

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # DeepSpeed casts the module itself under bf16

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)

    def backward(self, loss: "torch.Tensor") -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def reset_optimizer(self) -> None:
        base = getattr(self.optimizer, "optimizer", self.optimizer)
        base.state.clear()

    def full_params(self) -> "dict[str, torch.Tensor] | None":
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        out: dict[str, Any] = {}
        for name, p in self.engine.module.named_parameters():
            t = safe_get_full_fp32_param(p) if p.requires_grad else None
            if t is None:  # frozen (LoRA base) or not managed by the optimizer
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    t = p.detach().float().clone()
            if self.rank == 0:
                out[name] = t.detach().to("cpu")
        return out if self.rank == 0 else None

    def owned_params(self, owner: "Callable[[str], int]") -> "dict[str, torch.Tensor]":
        """ZeRO-1/2: the module's parameters are whole on every rank after each step (DeepSpeed
        copies the updated masters into them, in bf16 under ``trainer.bf16``: the bits a bf16 publish
        of the masters has), so each owner reads its own, with no communication. ZeRO-3: each one
        gathered (an all-gather), kept by its owner."""
        import deepspeed

        out: dict[str, Any] = {}
        for name, p in self.engine.module.named_parameters():
            if self.tcfg.zero_stage < 3:
                if owner(name) == self.rank:
                    out[name] = p.detach()
                continue
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if owner(name) == self.rank:
                    out[name] = p.detach().clone()
        return out

    def param_numels(self) -> dict[str, int]:
        return {n: int(getattr(p, "ds_numel", p.numel())) for n, p in self.engine.module.named_parameters()}

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder), tag=_TAG, save_latest=False)

    def load(self, folder: Path) -> None:
        self.engine.checkpoint_engine.load = weights_only_load  # instead of its weights_only=False load
        path, _ = self.engine.load_checkpoint(str(folder), tag=_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {folder}")
