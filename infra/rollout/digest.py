"""Digests of served weights: one sha256 per tensor over its dtype, shape and raw bytes.

The rollout worker reports them from inside the engine (:mod:`infra.rollout.vllm_ext` for vLLM, the
model's parameters for the local engine) and anyone holding the published tensors computes the same
with :func:`state_digests`: equal digests mean the served weights are bit-identical to the
published ones, tensor by tensor.
"""

from __future__ import annotations

import hashlib
from typing import Any


def tensor_digest(tensor: Any) -> str:
    """sha256 (hex) of ``tensor``'s dtype, shape and bytes (CPU copy, contiguous)."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(dtype=_byte_dtype()).numpy().tobytes())
    return h.hexdigest()


def state_digests(tensors: dict[str, Any]) -> dict[str, str]:
    """:func:`tensor_digest` of every tensor, by name."""
    return {name: tensor_digest(t) for name, t in tensors.items()}


def _byte_dtype() -> Any:
    import torch

    return torch.uint8
