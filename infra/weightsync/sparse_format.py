"""The body of a sparse frame: the constants and word arithmetic both of its coders share.

A sparse frame (see :mod:`infra.weightsync.codec` for the frame header) is written and read by two
coders that must produce the same bytes: the numba kernels (:mod:`infra.weightsync.numba_kernels`)
and their numpy reference (:mod:`infra.weightsync.reference`). This module holds what they agree
on, so neither imports the other. Body layout, after the codec's frame header::

    positions: mode byte 0, rice(idx)                                   (plain)
           or  mode byte 1, <QB> thr, comp, rice(ranks), rice(normal)   (split by base magnitude)
    values:    <Q> length, then zstd of: zigzag(new - old) of each changed word, stably ordered by
               the base word's exponent byte, byte-split into w planes

``rice(p)`` = ``<BQQ>`` k, unary bit count, count; unary parts of the gaps ``p_i - p_{i-1} - 1``
(MSB-first bits), then their k low bits as big-endian k-bit fields (:mod:`infra.weightsync.bitpack`).
"""

from __future__ import annotations

import struct
from typing import Callable

import numpy as np

HotSource = Callable[[int], np.ndarray]  # threshold -> sorted positions of the words below it

POS_PLAIN, POS_SPLIT = 0, 1  # position stream mode byte
SPLIT_HDR = struct.Struct("<QB")  # threshold (masked word value), complement flag
RICE_HDR = 17  # struct "<BQQ": k, unary bits, count
MIN_SPLIT = 64  # fewer changes than this: always plain positions


def word_consts(w: int) -> tuple[int, int, int]:
    """(key shift, key mask, magnitude mask) of ``w``-byte words.

    The key is the exponent-ish byte of a word, bits (8w-2)..(8w-9) (the 7 low bits for w=1): the
    value coder groups changed words by it. The magnitude is every bit below the top (sign) bit:
    the hot class of the split position code is the words whose magnitude is below a threshold."""
    if w == 1:
        return 0, 0x7F, 0x7F
    return 8 * w - 9, 0xFF, (1 << (8 * w - 1)) - 1


def magnitude_mask(w: int) -> int:
    """The bits below a ``w``-byte word's top (sign) bit: its magnitude for the hot class."""
    return word_consts(w)[2]
