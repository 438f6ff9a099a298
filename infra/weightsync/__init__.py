"""Weight sync: every policy version from the trainer to the rollout workers, through an object store.

The trainer publishes every version after the first as a delta against the previous one: per chunk
of every tensor, the changed words of its raw bytes, coded near their entropy, with an xxh3-128
digest; a manifest written last commits the version as soon as its delta is uploaded. Snapshots
(full copies of a version, what a late joiner starts from) are written in the background, below
deltas, when the delta chain since the last one outgrows a fraction of a snapshot, and committed by
their own manifest. Readers replay from the version they hold, or from the newest committed
snapshot at or below their target, and verify every chunk. The format, the guarantees and
measured numbers are in ``docs/weightsync.md``.

Usage::

    pub = VersionPublisher(store, prefix="runs/<run>/weights", snapshot_chain_fraction=1.0,
                           codec="auto", zstd_level=1, threads=2)
    info = pub.publish(tensors)            # -> PublishInfo; snapshot=True asks for one of this version
    rd = VersionReader(store, prefix="runs/<run>/weights", threads=2)
    rd.latest()                            # -> int | None
    tensors, version = rd.fetch(target=None, have=None, have_version=None)
    pub.close(); rd.close()                # stop their threads (close abandons a snapshot in flight;
                                           # close(wait_snapshot=True) finishes it)

The package, in reading order (each module's docstring says what it does and why):

=======================  ===========================================================================
``publisher.py``         :class:`VersionPublisher`: encode chunks on a thread pool, upload shards
                         while encoding, write the manifest last; the snapshot cadence
``snapshot.py``          :class:`SnapshotLane`: snapshots on a background thread, below deltas
``parts.py``             sharded publishing: :class:`PartPublisher` per trainer rank, part 0 merges
                         the shares into one manifest (``weight_sync.publish_ranks``)
``shards.py``            frames packed into shard objects that upload while encoding continues
``reader.py``            :class:`VersionReader`: pick a replay path, check and verify every chunk,
                         fall back to older snapshots on a fault
``reader_tensors.py``    the reader's tensor checks (dtypes, the caller's base) and its outputs
``recovery.py``          which replay paths are still worth trying after a fault
``schedule.py``          the reader's pipeline: byte ranges downloaded and decoded in version order
``tailstream.py``        a manifest read as it arrives: the delta frames it carries decode as they come
``errors.py``            :class:`WeightSyncError` and its subclasses (each names version and tensor)
``layout.py``            object names, the manifest format, chunk bounds, version listing
``validate.py``          the checks of every name, size, count and offset a manifest gives
``gc.py``                :func:`collect`: delete versions no reader path still needs
``folder.py``            safetensors folders <-> versions (``deltaloop sync publish/fetch``)
``chunks.py``            the per-chunk work of publisher and reader: encode, decode + verify
``codec.py``             frames: ``raw`` (full versions, snapshots), ``xor`` (reference), ``sparse`` (deltas)
``hotwords.py``          the publisher's hot-word lists, kept across versions
``kernels.py``           the sparse codec's hot loops: numba kernels or the numpy reference
``sparse_format.py``     the sparse frame body: constants and word arithmetic both coders share
``reference.py``         the numpy reference coder (the definition; the fallback without numba)
``numba_kernels.py``     the numba kernels, byte-identical to the reference
``native.py``            xxh3-128 and zstd decompression callable from numba kernels
``bitpack.py``           Rice coding of sorted positions (numpy)
``rawbytes.py``          tensors as unsigned words of their raw bytes; bit-exact compare
``pools.py``             thread pools kept across calls, and settling abandoned work
``warmup.py``            :func:`warm_up`: compile or load every kernel before the first sync
``broadcast.py``         ``weight_sync.placement: broadcast``: trainer rank 0 sends whole bf16
                         versions to the rollout workers over a gloo group of their own
=======================  ===========================================================================

``infra/gcpause.py`` holds the cyclic garbage collector off during ``publish`` and ``fetch``.
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
from infra.weightsync.folder import FolderError, read_folder, read_marker, write_folder
from infra.weightsync.gc import collect
from infra.weightsync.layout import Manifest, scan_versions
from infra.weightsync.publisher import PublishInfo, VersionPublisher
from infra.weightsync.reader import VersionReader
from infra.weightsync.warmup import warm_up

__all__ = [
    "CorruptData",
    "FolderError",
    "IncompatibleTensors",
    "Manifest",
    "ManifestError",
    "MissingObject",
    "PublishInfo",
    "VersionNotFound",
    "VersionPublisher",
    "VersionReader",
    "WeightSyncError",
    "WrongBase",
    "collect",
    "read_folder",
    "read_marker",
    "scan_versions",
    "warm_up",
    "write_folder",
]
