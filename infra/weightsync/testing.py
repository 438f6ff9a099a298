"""Test helpers for weight sync: a small bf16 model that drifts like RL updates, bit-exact compare."""

from __future__ import annotations

import torch


class Drift:
    """fp32 master weights; each step adds an Adam-like ±lr update; ``bf16()`` is what is synced."""

    def __init__(self, seed: int = 0, scale: int = 1) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.master = {
            "embed.weight": torch.randn(512 * scale, 64, generator=self.g) * 0.05,
            "layers.0.q.weight": torch.randn(64, 64, generator=self.g) * 0.05,
            "layers.0.mlp.weight": torch.randn(256, 64, generator=self.g) * 0.05,
            "norm.weight": torch.ones(64),
        }
        self.extra = {"step": torch.tensor(0, dtype=torch.int64), "mask": torch.zeros(5, dtype=torch.bool)}

    def step(self, lr: float = 2e-5) -> None:
        for v in self.master.values():
            v.add_(lr * torch.sign(torch.randn(v.shape, generator=self.g)))
        self.extra["step"] += 1

    def bf16(self) -> dict[str, torch.Tensor]:
        out = {k: v.to(torch.bfloat16) for k, v in self.master.items()}
        out.update({k: v.clone() for k, v in self.extra.items()})
        return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality of two tensor dicts (same names, dtypes, shapes, bytes)."""
    if list(sorted(a)) != list(sorted(b)):
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        # integer compare of the raw bytes: bit-exact (NaN payloads, -0.0), and without building
        # Python lists (the benchmark checks a 269 MB model after every timed sync)
        if not torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)):
            return False
    return True
