"""Which replay paths a reader still tries after a fault.

A fetch tries paths (:mod:`infra.weightsync.reader`); when one fails on a store object, the part of
the version that object belongs to (its keyframe frames or its delta frames) is recorded, and every
later path through that part is skipped: store objects are immutable, so it would fail again.
"""

from __future__ import annotations

from infra.weightsync.errors import ManifestError, WeightSyncError, WrongBase
from infra.weightsync.layout import MANIFEST, SNAPSHOT, SNAPSHOT_TAG


def bad_parts(bad: dict[int, set[str]], exc: WeightSyncError) -> None:
    """Record in ``bad`` which frames of the version ``exc`` names cannot be used: ``"k"`` (its
    keyframe frames: a full version's shards, or its snapshot's shards or manifest), ``"d"`` (its
    delta shards and the delta frames its manifest carries), or both (its manifest does not
    parse). Faults of the caller's tensors (:class:`WrongBase`) and faults that name no object
    record nothing. Objects are immutable, so a path through a recorded part
    fails again: :func:`viable` skips it."""
    if exc.version is None or exc.key is None or isinstance(exc, WrongBase):
        return
    name = exc.key.rsplit("/", 1)[-1]
    if name == SNAPSHOT or name.startswith(SNAPSHOT_TAG + "-"):  # the snapshot, not the version
        parts = {"k"}
    elif isinstance(exc, ManifestError):
        parts = {"k", "d"}
    elif name.startswith("k-"):
        parts = {"k"}
    elif name.startswith("d-") or name == MANIFEST:
        parts = {"d"}
    else:  # a side file: not on any replay path
        return
    bad.setdefault(exc.version, set()).update(parts)


def viable(bad: dict[int, set[str]], goal: int, start: int | None, keyframe: bool) -> bool:
    """Whether a replay to ``goal`` from ``start`` (its keyframe frames when ``keyframe``, else the
    caller's tensors at ``start``), then the delta frames of ``start+1..goal``, avoids every part
    recorded in ``bad``."""
    if start is None or (keyframe and "k" in bad.get(start, ())):
        return False
    return not any("d" in bad.get(v, ()) for v in range(start + 1, goal + 1))

