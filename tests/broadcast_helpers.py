"""Test helpers for the broadcast group (:mod:`infra.weightsync.broadcast`): a receiver that runs in a
process of its own (``spawn``), reporting what it got through a queue, and the tensors a sender sends."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import torch


def versions() -> list[dict[str, torch.Tensor]]:
    """Two versions of a small state: bf16 matrices of odd sizes, a 0-d tensor and an empty one."""
    g = torch.Generator().manual_seed(3)
    v1 = {"embed.weight": torch.randn(257, 33, generator=g).to(torch.bfloat16),
          "layers.0.q.weight": torch.randn(64, 63, generator=g).to(torch.bfloat16),
          "norm.weight": torch.ones(63, dtype=torch.bfloat16), "scale": torch.tensor(0.5, dtype=torch.bfloat16),
          "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}
    v2 = {k: (t.float() + 0.01).to(torch.bfloat16) for k, t in v1.items()}
    return [v1, v2]


def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's dtype, shape and bytes."""
    out = {}
    for k, t in tensors.items():
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out[k] = h.hexdigest()
    return out


def receiver(inbox: Any, rank: int, mode: str, q: Any) -> None:
    """Join the group whose address arrives on ``inbox`` as ``rank`` and act out ``mode``: ``ok`` receives versions 1, 2, a not-held 3 and 4;
    ``mismatch`` expects a different layout for version 1 then takes version 2; ``die`` joins and
    exits at once; ``stall`` joins and never receives; ``wait`` receives once (its sender dies)."""
    from infra.weightsync.broadcast import BroadcastGroup, GroupAddress, Receiver

    torch.set_num_threads(1)
    q.put(("ready", rank, None))  # imports done: the group's timeout then covers the join alone
    addr = GroupAddress.from_json(inbox.get())
    group = BroadcastGroup(addr, rank, "127.0.0.1")
    rx = Receiver(group, max_bytes=1 << 24)
    q.put(("joined", rank, None))
    if mode == "die":
        q.close()
        q.join_thread()  # "joined" is delivered before the process vanishes
        os._exit(3)
    if mode == "stall":
        time.sleep(60)
        return
    if mode == "mismatch":
        try:
            rx.receive(1, expected={"other": ("bfloat16", (1,))})
        except Exception as exc:  # reported to the test
            q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        got = rx.receive(2)
        q.put(("got", rank, (got.version, fingerprint(got.tensors or {}))))
        rx.receive(3)
        rx.receive(4)
        return
    t0 = time.monotonic()
    try:
        for v in ((1, 2, 3, 4) if mode == "ok" else (1,)):
            got = rx.receive(v)
            q.put(("got", rank, (got.version, fingerprint(got.tensors) if got.tensors else None, got.held, got.bytes)))
    except Exception as exc:
        q.put(("error", rank, f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}"))
