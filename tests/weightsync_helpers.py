"""Test helpers for weight sync: a small bf16 model that drifts like RL updates, random word pairs
for the codec, the bit-exact compare (``same``, from :mod:`infra.weightsync.rawbytes`), and manifest
objects decoded and re-encoded as plain JSON (to craft what a writer of the store could write)."""

from __future__ import annotations

import numpy as np
import torch

from infra.weightsync.rawbytes import same_bits as same

__all__ = ["Drift", "manifest_blob", "manifest_doc", "same", "word_pair"]


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
        """One update: every master weight moves by ±lr."""
        for v in self.master.values():
            v.add_(lr * torch.sign(torch.randn(v.shape, generator=self.g)))
        self.extra["step"] += 1

    def bf16(self) -> dict[str, torch.Tensor]:
        """The tensors to sync: bf16 casts of the masters, plus an int64 and a bool tensor."""
        out = {k: v.to(torch.bfloat16) for k, v in self.master.items()}
        out.update({k: v.clone() for k, v in self.extra.items()})
        return out


def word_pair(rng: np.random.Generator, trial: int) -> tuple[np.ndarray, np.ndarray]:
    """Random words of every width; every third case has a rare "tiny magnitude" class that
    changes almost surely (what makes the encoder split positions by the base's magnitude)."""
    dt = [np.uint8, np.uint16, np.uint32, np.uint64][trial % 4]
    w = np.dtype(dt).itemsize
    n = int(rng.integers(1, 20000))
    old = rng.integers(0, 1 << min(63, 8 * w), n, dtype=np.uint64).astype(dt)
    changed = rng.random(n) < rng.choice([0.001, 0.01, 0.1, 0.5, 0.95])
    step = rng.choice(np.array([1, (1 << 8 * w) - 1], np.uint64), n).astype(dt)  # +-1 ulp moves
    if trial % 3:
        step = rng.integers(1, 20, n).astype(dt)
    new = old.copy()
    new[changed] += step[changed]
    if trial % 3 == 0:
        tiny = rng.random(n) < rng.choice([0.002, 0.05])
        old[tiny] &= dt((1 << max(1, 8 * w - 5)) - 1)
        new[tiny] = old[tiny]
        moved = tiny & (rng.random(n) < 0.9)
        new[moved] += rng.integers(4, 100, n).astype(dt)[moved]
    return old, new


def manifest_doc(blob: bytes) -> tuple[dict, bytes]:
    """``(JSON document, carried frames)`` of a manifest object, decoded here rather than by the code
    under test, so tests can craft what an attacker with write access to the store would write."""
    import json
    import struct

    import zstandard

    tail = b""
    if blob[:4] == b"DLM2":
        (n,) = struct.unpack_from("<I", blob, 4)
        blob, tail = blob[8 : 8 + n], blob[8 + n :]
    return json.loads(zstandard.ZstdDecompressor().decompress(blob, max_output_size=1 << 28)), tail


def manifest_blob(doc: object, tail: bytes = b"") -> bytes:
    """Inverse of :func:`manifest_doc`: any JSON value (valid or not) as a manifest object."""
    import json
    import struct

    import zstandard

    packed = zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, separators=(",", ":")).encode())
    return b"DLM2" + struct.pack("<I", len(packed)) + packed + tail if tail else packed
