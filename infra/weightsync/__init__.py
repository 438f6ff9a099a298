"""Weight sync: versioned keyframe + delta checkpoints in an object store, and same-cluster broadcast.

Public API::

    pub = VersionPublisher(store, prefix="runs/<run>/weights", keyframe_every=10, codec="auto",
                           zstd_level=1, threads=2)
    info = pub.publish(tensors)            # -> PublishInfo
    rd = VersionReader(store, prefix="runs/<run>/weights", threads=2)
    rd.latest()                            # -> int | None
    tensors, version = rd.fetch(target=None, have=None, have_version=None)

See ``docs/weightsync.md`` for the format, the guarantees and measured numbers.
"""

from infra.weightsync.errors import (
    CorruptData,
    IncompatibleTensors,
    ManifestError,
    MissingObject,
    VersionNotFound,
    WeightSyncError,
    WrongBase,
)
from infra.weightsync.gc import collect
from infra.weightsync.publisher import PublishInfo, VersionPublisher
from infra.weightsync.reader import VersionReader

__all__ = [
    "CorruptData",
    "IncompatibleTensors",
    "ManifestError",
    "MissingObject",
    "PublishInfo",
    "VersionNotFound",
    "VersionPublisher",
    "VersionReader",
    "WeightSyncError",
    "WrongBase",
    "collect",
]
