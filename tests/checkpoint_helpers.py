"""Shared pieces of the checkpoint tests: a tiny torch engine and the run secret the ranks get."""

from __future__ import annotations

import os
from typing import Any

import pytest


def tiny_engine(seed: int) -> Any:
    """A :class:`~infra.train.engines.TorchEngine` over a 2-layer MLP (one rank), seeded."""
    import torch

    from infra.config import TrainerConfig
    from infra.train.engines import TorchEngine

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return TorchEngine(model, TrainerConfig(lr=1e-2), world=1, rank=0)


def set_run_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh run secret in the environment, as the trainer ranks receive it (checkpoints are signed)."""
    from infra.secrets import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, os.urandom(32).hex())
