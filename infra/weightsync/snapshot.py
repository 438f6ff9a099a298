"""The snapshot lane: full copies of committed versions, written in the background below deltas.

A late joiner replays from the newest committed snapshot at or below its target plus the deltas
after it. Writing that snapshot inside a version's publish would make that version wait for a
full-model upload (~185 MB for SmolLM2-135M, 3.7 s of a 50 MB/s link), so the publisher commits
every version as a delta and hands snapshots to this lane: one thread of its own, with its own
upload thread, that

- **yields to deltas**: before each chunk it encodes and each shard it uploads, it waits while a
  delta publish is running (:meth:`SnapshotLane.hold` / :meth:`SnapshotLane.release`), so a delta
  never shares the encode threads or the uplink with it, except for at most one chunk encode
  (~10 ms) and one shard PUT (``shard_bytes``, 32 MiB) already under way when the publish began;
  a publish never waits for the lane (:meth:`SnapshotLane.wait_copied` below is a memory copy);
- **commits last**: the snapshot's manifest (``snapshot.json.zst``, :mod:`infra.weightsync.layout`)
  is written after every ``s-`` shard upload succeeded, so a reader only sees complete snapshots.
  A snapshot that fails (a storage error) or is abandoned (:meth:`SnapshotLane.abandon`, from
  ``close`` or ``republish``) writes no manifest; the lane deletes the shards it wrote, and what a
  killed process leaves is deleted by the next publisher and by GC (:func:`infra.weightsync.gc.collect`).

**Immutable weights.** The publisher updates its private base copy in place at every delta, and the
trainer keeps training while a snapshot uploads. The lane therefore first copies the base (the
words of the version being snapshotted) into arrays of its own, and encodes from that copy; the
publisher's next publish waits only for this copy (:meth:`SnapshotLane.wait_copied`: one pass
over the model at memory speed, ~0.1 s for 270 MB on the 2-vCPU VM, normally finished during the
training step that comes between two publishes). Memory cost: one more copy of the model's bytes
(2 bytes a parameter in bf16) while a snapshot is in flight, plus ~3 chunks of encode temporaries
and up to two shards (2 x ``shard_bytes``) queued for upload. Every chunk's digest is checked
against the version's manifest as it is encoded, so a snapshot can only commit the bits the
version holds.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from infra.errors import DeltaloopError
from infra.weightsync.chunks import encode_chunk
from infra.weightsync.errors import WeightSyncError
from infra.weightsync.layout import (
    SNAPSHOT_TAG,
    ChunkEntry,
    Manifest,
    TensorEntry,
    chunk_bounds,
    fragment_key,
    snapshot_key,
    tensor_digest,
    version_dir,
)
from infra.weightsync.shards import Shards

if TYPE_CHECKING:
    from infra.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class SnapshotJob:
    """Everything the lane needs to snapshot one committed version."""

    version: int
    words: dict[str, np.ndarray]  # the publisher's base: copied by the lane before anything else
    sig: list[tuple[str, str, tuple[int, ...]]]  # names, dtypes, shapes, in order
    nbytes: dict[str, int]
    digests: dict[str, list[str]]  # the version's chunk digests (what every encoded chunk must match)
    files: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class SnapshotResult:
    """One snapshot that ended: committed (``error`` None) or not."""

    version: int
    bytes_written: int  # shard bytes + manifest (uploaded, also when it failed part-way)
    error: BaseException | None = None


class _Abandoned(DeltaloopError):
    """The lane was told to stop: the snapshot ends without a manifest (caught inside the lane)."""


class SnapshotLane:
    """One snapshot at a time, on a background thread, below the publisher's deltas (module docstring)."""

    def __init__(self, store: "ObjectStore", prefix: str, chunk_bytes: int, shard_bytes: int, level: int,
                 part: str = "") -> None:
        self.store, self.prefix, self.part = store, prefix, part  # part: see VersionPublisher
        self.chunk_bytes, self.shard_bytes, self.level = chunk_bytes, shard_bytes, level
        self._idle = threading.Event()  # set while no delta publish runs
        self._idle.set()
        self._copied = threading.Event()  # set once the in-flight snapshot no longer reads the base
        self._copied.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._version: int | None = None
        self._results: list[SnapshotResult] = []
        self.bytes_written = 0  # by every snapshot this lane ran (committed or not)

    # ------------------------------------------------------------------ the publisher's side
    @property
    def busy(self) -> int | None:
        """The version being snapshotted, or None."""
        with self._lock:
            return self._version

    def start(self, job: SnapshotJob) -> None:
        """Snapshot ``job.version`` in the background (the lane must be idle)."""
        with self._lock:
            if self._version is not None:
                raise RuntimeError(f"a snapshot of version {self._version} is still in flight")
            self._version = job.version
            self._stop.clear()
            self._copied.clear()
            self._thread = threading.Thread(target=self._run, args=(job,), name=f"ws-snapshot-{job.version}",
                                            daemon=True)  # a killed process leaves no manifest: GC cleans up
        self._thread.start()

    def hold(self) -> None:
        """A delta publish starts: the lane pauses at its next chunk or shard."""
        self._idle.clear()

    def release(self) -> None:
        """The delta publish ended: the lane goes on."""
        self._idle.set()

    def wait_copied(self) -> None:
        """Wait until the in-flight snapshot has its own copy of the base (the caller may then
        change the base): a memory copy, never an upload."""
        self._copied.wait()

    def take(self) -> list[SnapshotResult]:
        """Snapshots that ended since the last call, oldest first."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight snapshot to end (committed or failed); False on timeout."""
        thread = self._thread
        if thread is None:
            return True
        self._idle.set()  # nothing to yield to while someone waits for it
        thread.join(timeout)
        return not thread.is_alive()

    def abandon(self) -> None:
        """Stop the in-flight snapshot without committing it, and wait for the lane to stop (at most
        one chunk encode and the shard uploads already started); its shards are deleted."""
        self._stop.set()
        self.wait()

    # ---------------------------------------------------------------------- the lane thread
    def _gate(self) -> None:
        """Yield to a running delta publish; raise :class:`_Abandoned` when told to stop."""
        while not self._idle.wait(0.05):
            if self._stop.is_set():
                break
        if self._stop.is_set():
            raise _Abandoned()

    def _run(self, job: SnapshotJob) -> None:
        written = 0
        shards: Shards | None = None
        error: BaseException | None = None
        try:
            try:
                names = [n for n, _dt, _shape in job.sig]
                words = {n: job.words[n].copy() for n in names}  # the version's bits, ours from here on
            finally:
                self._copied.set()
            with ThreadPoolExecutor(1, f"ws-snapshot-put-{job.version}") as io:
                pending: deque[Future] = deque()
                shards = Shards(self.store, version_dir(self.prefix, job.version), SNAPSHOT_TAG + self.part,
                                self.shard_bytes, io, pending)
                try:
                    man = self._encode(job, names, words, shards, pending)
                    self._gate()
                    shards.flush()
                    while pending:
                        pending.popleft().result()
                finally:
                    written = shards.written
                    for f in pending:  # an abandoned or failed snapshot: let started uploads end
                        f.cancel()
                del words
                blob = man.to_bytes()
                self._gate()
                # commit point; a part's share is merged with the others' by the committer (parts.py)
                key = fragment_key(self.prefix, job.version, self.part) if self.part else snapshot_key(
                    self.prefix, job.version)
                self.store.put(key, blob)
                written += len(blob)
            log.info("snapshot%s of version %d written (%d bytes)", self.part, job.version, written)
        except _Abandoned as exc:
            error = exc
            log.info("snapshot of version %d abandoned", job.version)
        except BaseException as exc:  # noqa: BLE001 - a storage error of any kind: recorded, retried later
            error = exc
            log.warning("snapshot of version %d failed: %s", job.version, exc)
        if error is not None and shards is not None:
            self._delete(shards.keys)
        with self._lock:
            self.bytes_written += written
            self._results.append(SnapshotResult(job.version, written, error))
            self._version = None

    def _encode(self, job: SnapshotJob, names: list[str], words: dict[str, np.ndarray], shards: Shards,
                pending: deque[Future]) -> Manifest:
        """Encode every chunk of the copy as a keyframe frame (at most two shard uploads queued);
        returns the snapshot's manifest."""
        tensors = []
        for n, dt, shape in job.sig:
            w = words[n]
            entries = []
            for ci, (s, e) in enumerate(chunk_bounds(len(w), w.dtype.itemsize, self.chunk_bytes)):
                self._gate()
                res = encode_chunk(None, w[s:e], keyframe=True, level=self.level)
                if res.digest != job.digests[n][ci]:
                    raise WeightSyncError(f"chunk {ci}: the snapshot's copy is not the committed version",
                                          version=job.version, tensor=n)
                entries.append(ChunkEntry(res.digest, k=shards.add(res.key, res.key_h)))  # type: ignore[arg-type]
                while len(pending) > 1:
                    pending.popleft().result()
            tensors.append(TensorEntry(n, dt, list(shape), job.nbytes[n],
                                       tensor_digest(n, dt, list(shape), [c.h for c in entries]), entries))
        return Manifest(version=job.version, keyframe=True, base=None, chunk_bytes=self.chunk_bytes,
                        shards=list(shards.names), shard_sizes=list(shards.sizes), tensors=tensors,
                        files=dict(job.files), meta=dict(job.meta), snapshot=True)

    def _delete(self, keys: list[str]) -> None:
        """Best effort: the shards of a snapshot that will never commit (GC deletes what is left)."""
        for key in keys:
            try:
                self.store.delete(key)
            except Exception as exc:  # noqa: BLE001 - the store may be what failed
                log.info("could not delete %s of an uncommitted snapshot (%s); GC will", key, exc)
