"""Raw-byte views of tensors: the codec never looks at float values, only at bits.

A tensor is turned into a flat numpy array of unsigned words as wide as its element (1, 2, 4 or 8
bytes; wider elements are split into 8-byte words), so bf16, fp16, fp32, fp8 and integer tensors go
through the same code and reconstruction is bit-exact (NaN payloads included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# element size of every dtype a version may hold, by :func:`dtype_name` (known without importing
# torch: a manifest's sizes are checked against it when parsed; the sub-byte, bit and quantized
# dtypes are not synced)
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
}


def word_width(element_size: int) -> int:
    """Word width (bytes) used for elements of ``element_size`` bytes."""
    for w in (8, 4, 2, 1):
        if element_size % w == 0:
            return w
    return 1


def word_dtype(width: int) -> type[np.unsignedinteger]:
    """numpy unsigned dtype of ``width`` bytes."""
    return _WORD[width]


def tensor_bytes(t: "torch.Tensor") -> np.ndarray:
    """The tensor's bytes as a flat uint8 numpy array (a view when already contiguous on CPU)."""
    import torch

    if t.device.type == "cpu" and t.dim() > 0 and t.is_contiguous() and t.dtype != torch.uint8:
        # the usual case, in half the torch calls (a publish or fetch does this for every tensor)
        return t.detach().view(torch.uint8).numpy().reshape(-1)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.uint8:
        return t.numpy()
    return t.view(torch.uint8).numpy()


def tensor_words(t: "torch.Tensor") -> np.ndarray:
    """The tensor's bytes viewed as unsigned words of :func:`word_width`."""
    raw = tensor_bytes(t)
    return raw.view(word_dtype(word_width(t.element_size())))


def dtype_name(dtype: "torch.dtype") -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> "torch.dtype":
    """Inverse of :func:`dtype_name`; raises ValueError for an unknown name."""
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


def bytes_to_tensor(buf: np.ndarray, dtype: "torch.dtype", shape: tuple[int, ...]) -> "torch.Tensor":
    """Wrap a uint8 numpy buffer as a tensor of ``dtype``/``shape`` without copying."""
    import torch

    raw = torch.from_numpy(buf.view(np.uint8).reshape(-1))
    if dtype != torch.uint8:
        raw = raw.view(dtype)
    return raw.reshape(shape)


def same_bits(a: dict[str, "torch.Tensor"], b: dict[str, "torch.Tensor"]) -> bool:
    """Bit-exact equality of two tensor dicts: same names, dtypes, shapes and raw bytes.

    Compares bytes, not values, so NaN payloads and -0.0 count, as the codec's guarantee does;
    ``torch.equal`` on uint8 views, no Python lists (checks of a 270 MB model stay cheap)."""
    import torch

    if sorted(a) != sorted(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)):
            return False
    return True
