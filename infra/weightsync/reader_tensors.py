"""The reader's checks of a version's tensors against what this process has, and its outputs.

Split from :mod:`infra.weightsync.reader`: the tensor-level rules (dtypes this torch knows, the
caller's base tensors matching the version's names, dtypes and shapes, chunk word ranges, the
chunks no frame touched checked against the goal) and how fetched bytes become the tensors handed
back (views, or the caller's own tensors when patched in place).
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import TYPE_CHECKING

import numpy as np

from infra.weightsync.errors import IncompatibleTensors, WrongBase
from infra.weightsync.layout import Manifest, TensorEntry, chunk_bounds, digest
from infra.weightsync.pools import settle
from infra.weightsync.rawbytes import DTYPE_SIZES, bytes_to_tensor, dtype_from_name, dtype_name, word_width

if TYPE_CHECKING:
    import torch


def chunk_ranges(dtype: str, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Word ranges of the chunks of a tensor of ``dtype`` (a manifest dtype name) and ``nbytes``."""
    width = word_width(DTYPE_SIZES[dtype])
    return chunk_bounds(nbytes // width, width, chunk_bytes)


def check_dtypes(tensors: list[TensorEntry], version: int) -> None:
    """Every dtype is one this torch has (else IncompatibleTensors, before anything is allocated)."""
    for t in tensors:
        try:
            dtype_from_name(t.dtype)
        except ValueError:
            raise IncompatibleTensors(f"dtype {t.dtype} is not one this torch has", version=version,
                                      tensor=t.name) from None


def check_have(have: dict[str, "torch.Tensor"], tensors: list[TensorEntry], version: int) -> None:
    """The caller's tensors have the names, dtypes and shapes of ``version`` (else IncompatibleTensors)."""
    names = [t.name for t in tensors]
    if sorted(have) != sorted(names):
        extra = sorted(set(have) ^ set(names))
        raise IncompatibleTensors("tensor names differ from the base", version=version, tensor=extra[0])
    for t in tensors:
        h = have[t.name]
        if dtype_name(h.dtype) != t.dtype or list(h.shape) != t.shape:
            raise IncompatibleTensors(
                f"have {dtype_name(h.dtype)}{list(h.shape)}, version has {t.dtype}{t.shape}",
                version=version, tensor=t.name,
            )


def fetched_tensors(tensors: list[TensorEntry], bufs: list[np.ndarray], have: dict[str, "torch.Tensor"] | None,
             inplace: bool) -> dict[str, "torch.Tensor"]:
    """The fetched tensors: views of ``bufs``, or with ``inplace`` the caller's own tensors (a
    tensor that was patched through a copy, being on another device or not contiguous, is written
    back)."""
    out: dict[str, "torch.Tensor"] = {}
    for t, b in zip(tensors, bufs):
        if inplace and have is not None:
            h = have[t.name]
            if not (h.device.type == "cpu" and h.is_contiguous()):  # we patched a copy: write it back
                h.copy_(bytes_to_tensor(b, dtype_from_name(t.dtype), tuple(t.shape)))
            out[t.name] = h
        else:
            out[t.name] = bytes_to_tensor(b, dtype_from_name(t.dtype), tuple(t.shape))
    return out


def verify_untouched(touched: list[list[bool]], bounds: list[list[tuple[int, int]]], words: list[np.ndarray],
                     final: Manifest, have_version: int | None, pool: Executor) -> None:
    """Chunks no frame touched still hold the caller's words: check them against the goal ``final``
    (on ``pool`` when there are many; else :class:`WrongBase`)."""
    untouched = [(ti, ci) for ti, row in enumerate(touched) for ci, done in enumerate(row) if not done]
    if not untouched:
        return

    def check(ti: int, ci: int) -> None:
        s, e = bounds[ti][ci]
        if digest(words[ti][s:e]) != final.tensors[ti].chunks[ci].h:
            raise WrongBase("the tensors given are not the claimed version", version=have_version,
                            tensor=final.tensors[ti].name)

    words_left = sum(bounds[ti][ci][1] - bounds[ti][ci][0] for ti, ci in untouched)
    if words_left < (1 << 20):  # e.g. the norm weights an RL step leaves alone: cheaper than tasks
        for ti, ci in untouched:
            check(ti, ci)
        return
    checks = [pool.submit(check, ti, ci) for ti, ci in untouched]
    try:
        for f in checks:
            f.result()
    finally:
        settle(checks)
