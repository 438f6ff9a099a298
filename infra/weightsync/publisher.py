"""Publishing weight versions: every version a delta, visible once the delta is durable;
snapshots in the background.

:class:`VersionPublisher` keeps a private copy of the last published words (the base), so a
delta never depends on what the caller does to its tensors afterwards. After a delta it updates the
base only at the changed positions (a scatter of ~1% of the words instead of a full copy).

**Versions.** Version N is a delta against N-1, committed by its manifest as soon as its delta
frames are uploaded. A version is *full* (every chunk's frame, no base) only when there is nothing
to diff against: the first version, the version after a failed publish (the base is then
unknown), a change of tensor names, shapes or dtypes, and :meth:`VersionPublisher.republish`.

**Snapshots** (full copies of a committed version: what a late joiner starts from) never hold up a
version: the :class:`~infra.weightsync.snapshot.SnapshotLane` writes them on its own threads, after
the version committed and below deltas in priority, with a manifest of their own written last (see
that module for how it copies the weights and what the copy costs). **Cadence**: a snapshot of
version N starts after N commits when the bytes of the delta chain since the newest start (the
last committed snapshot or full version) exceed ``snapshot_chain_fraction`` times that start's
size, and no snapshot is in flight. A late joiner then downloads at most one snapshot plus
``snapshot_chain_fraction`` of one in deltas (plus those published while the snapshot was in
flight), and the publisher uploads ``1 + 1/fraction`` times the delta bytes per version,
amortised. The default 1.0 puts both at twice their floor: a joiner reads at most ~2 snapshots'
bytes, the publisher ~2 deltas a version. Per-version bytes are paid at every step, a joiner's
once; at 0.5 (joiner 1.5 snapshots, uploads 3 deltas) consecutive AdamW steps at lr 1e-6 on a
2-layer SmolLM2 measured 1.23% of the bf16 bytes a version (deltas 0.41%), over the 1% target;
the default's number is in ``docs/weightsync.md`` (Measured).

Streaming and memory bound: chunks (``chunk_bytes``, default 4 MiB) are encoded by ``threads``
workers with at most ``2 * threads`` tasks in flight (a task is one full-version chunk, or
``DELTA_TASK_CHUNKS`` delta chunks, whose frames are small); frames are appended in chunk order to
shards that upload on ``io_threads`` threads while encoding continues, with at most
``2 * io_threads`` shards queued. Delta frames go to shards of ``delta_shard_bytes`` (default
4 MiB): a large delta uploads while the rest of the model is still being encoded rather than as one
object after the last chunk, and the last, partly filled delta shard is not uploaded on its own but
carried by the manifest object, so one PUT follows the last chunk. At lr 1e-6 the whole delta
(~0.75 MB, 15 ms of a 50 MB/s link) fits that one shard, so a reader gets a version in one GET and
one round trip. Smaller shards mean more requests for a large delta, each costing both ends CPU;
readers decode a shard's frames, and those the manifest carries, as their bytes arrive, so a
larger shard does not hold their decode back (side by side with 4 readers across 40 ms / 50 MB/s links: 4 MiB took the slowest version,
the first AdamW step's 5.7 MB delta, from 0.44-0.45 s to 0.40 s against 1 MiB, and 256 KiB cost a
second round trip, ``docs/weightsync.md``). Peak extra memory over the base copy is about
``2*threads*chunk_bytes*3 + (2*io_threads+2)*shard_bytes`` for a full version (~350 MiB at
defaults; a delta at lr 1e-6 is ~0.5% of the model), plus one model copy while a snapshot is in
flight. A version becomes visible when its manifest is written, after every shard upload
succeeded; if publish fails midway nothing is visible, the base is marked unknown and the next
version is full.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from infra.gcpause import deferred_gc
from infra.weightsync.chunks import EncodedChunk, encode_chunk
from infra.weightsync.codec import CodecName
from infra.weightsync.errors import IncompatibleTensors, VersionNotFound, WeightSyncError
from infra.weightsync.gc import clean_orphans, collect
from infra.weightsync.hotwords import HotWords
from infra.weightsync.layout import (
    KEYFRAME_MARK,
    TAIL_SHARD,
    ChunkEntry,
    Manifest,
    TensorEntry,
    chunk_bounds,
    digest,
    files_key,
    manifest_key,
    scan_versions,
    tensor_digest,
    version_dir,
)
from infra.weightsync.pools import Pools, settle
from infra.weightsync.rawbytes import DTYPE_SIZES, dtype_name, tensor_words
from infra.weightsync.reader import VersionReader
from infra.weightsync.shards import Shards
from infra.weightsync.snapshot import SnapshotJob, SnapshotLane
from infra.weightsync.warmup import warm_up

if TYPE_CHECKING:
    import torch

    from infra.storage import ObjectStore

log = logging.getLogger(__name__)

DELTA_TASK_CHUNKS = 4  # chunks per encode task of a delta version
DEFAULT_CHAIN_FRACTION = 1.0  # see the module docstring
DEFAULT_DELTA_SHARD_BYTES = 4 << 20  # see the module docstring (streaming)


@dataclass
class PublishInfo:
    """What one :meth:`VersionPublisher.publish` did."""

    version: int
    kind: str  # "keyframe" (a full version) | "delta"
    bytes_written: int
    raw_bytes: int
    seconds: float
    changed_fraction: float
    snapshot_started: bool = False  # a background snapshot of this version began after it committed

    def record(self, t0: float) -> dict[str, Any]:
        """The trainer's record of this publish: ``seconds`` from the caller's ``t0`` (taking the
        tensors from the engine included), ``encode_seconds`` the publisher's own."""
        return {"version": self.version, "kind": self.kind, "bytes_written": self.bytes_written,
                "raw_bytes": self.raw_bytes, "encode_seconds": self.seconds, "seconds": time.perf_counter() - t0,
                "changed_fraction": self.changed_fraction}


class VersionPublisher:
    """Writes versions 1, 2, ... under ``prefix``: each a delta on the previous one, with snapshots
    in the background when the delta chain since the last one grows past ``snapshot_chain_fraction``
    of a snapshot.

    Constructed over a store that already holds versions, it continues after the newest committed
    one, reading it back as the base (the first publish is a full version if that read fails). Call
    :meth:`close` when done: it abandons (or, with ``wait_snapshot=True``, finishes) the snapshot
    in flight.
    """

    def __init__(
        self,
        store: "ObjectStore",
        prefix: str,
        snapshot_chain_fraction: float = DEFAULT_CHAIN_FRACTION,
        codec: CodecName = "auto",
        zstd_level: int = 1,
        threads: int = 2,
        *,
        chunk_bytes: int = 4 << 20,
        shard_bytes: int = 32 << 20,
        delta_shard_bytes: int = DEFAULT_DELTA_SHARD_BYTES,
        io_threads: int = 4,
        keep_versions: int = 0,
        part: str = "",
    ) -> None:
        warm_up()  # compile/load the codec kernels now, not inside a timed publish/fetch
        if not snapshot_chain_fraction >= 0:
            raise ValueError(f"snapshot_chain_fraction must be >= 0, got {snapshot_chain_fraction}")
        if codec not in ("auto", "xor", "sparse"):
            raise ValueError(f"unknown codec {codec!r}; known: auto, xor, sparse")
        self.store, self.prefix = store, prefix.strip("/")
        self.chain_fraction, self.codec, self.level = float(snapshot_chain_fraction), codec, zstd_level
        self.threads, self.chunk_bytes, self.shard_bytes = max(1, threads), chunk_bytes, shard_bytes
        self.delta_shard_bytes = delta_shard_bytes
        self.io_threads, self.keep_versions = max(1, io_threads), keep_versions
        self.part = part  # shard-name infix of one part of a sharded publish ("" when alone: parts.py)
        self.carry_bytes = delta_shard_bytes  # most delta frames the manifest object carries (parts: a share)
        self._base: dict[str, np.ndarray] | None = None  # name -> private copy of words
        self._sig: list[tuple[str, str, tuple[int, ...]]] = []
        self._digests: dict[str, list[str]] = {}
        self._files: dict[str, str] = {}  # side-file name -> digest already stored
        self._meta: dict[str, Any] = {}  # the newest version's meta (its snapshot carries it too)
        self._hot = HotWords()  # hot-word lists of the base's chunks, kept across versions
        self._pools = Pools(self)  # encode and upload threads, made once
        self._lane = SnapshotLane(self.store, self.prefix, chunk_bytes, shard_bytes, zstd_level, part=part)
        self._start = 0  # newest start (committed snapshot or full version); 0: none known
        self._start_bytes = 0  # its frame bytes: the size of a snapshot
        self._chain: list[tuple[int, int]] = []  # (version, bytes) of the deltas after it
        self._want_snapshot = False  # a snapshot was asked for while another was in flight
        listing = scan_versions(store.list(self.prefix + "/"))
        self.version = listing.committed[-1] if listing.committed else 0
        if not part:
            clean_orphans(store, self.prefix, listing)
        if self.version:
            self._resume(listing.starts)

    def _resume(self, starts: set[int], names: list[str] | None = None) -> None:
        """Read the newest committed version back as the base (only ``names`` of it, in that order,
        for one part of a sharded publish) and the snapshot cadence's state."""
        reader = VersionReader(self.store, self.prefix, threads=self.threads, names=names)
        try:
            tensors, v = reader.fetch(self.version)
            man = reader.manifest(v)
        except WeightSyncError as exc:
            log.warning("cannot read back version %d as base (%s); next version is full", self.version, exc)
            return
        if man.chunk_bytes != self.chunk_bytes:
            log.info("version %d used chunk_bytes %d; next version is full", v, man.chunk_bytes)
            return
        order = names if names is not None else [t.name for t in man.tensors]
        entries = {t.name: t for t in man.tensors}
        self._base = {k: tensor_words(tensors[k]).copy() for k in order}
        self._sig = [(k, entries[k].dtype, tuple(entries[k].shape)) for k in order]
        self._digests = {k: [c.h for c in entries[k].chunks] for k in order}
        self._files = dict(man.files)
        self._meta = dict(man.meta)
        self._restore_chain(reader, starts)

    def _restore_chain(self, reader: VersionReader, starts: set[int]) -> None:
        """The snapshot cadence's state from the store: the newest start and the delta bytes after it
        (manifests the resume fetch has mostly read already)."""
        below = [s for s in starts if s <= self.version]
        if not below:
            return
        try:
            start = max(below)
            sman = reader.manifest(start) if reader.manifest(start).keyframe else reader.snapshot(start)
            chain = []
            for v in range(start + 1, self.version + 1):
                chain.append((v, sum(reader.manifest(v).shard_sizes)))
        except WeightSyncError as exc:
            log.info("snapshot cadence restarts from scratch (%s)", exc)
            return
        self._start = start
        self._start_bytes = sum(size for name, size in zip(sman.shards, sman.shard_sizes) if name[:2] in ("k-", "s-"))
        self._chain = chain

    def close(self, wait_snapshot: bool = False) -> None:
        """Stop this publisher's threads (a later publish starts new ones). The snapshot in flight is
        abandoned (it commits nothing; its shards are deleted), or with ``wait_snapshot`` finished
        first (a one-shot publisher, like ``deltaloop sync publish``, has no later chance); a
        snapshot that fails is logged, not raised (every version is committed without it)."""
        try:
            if wait_snapshot:
                self.wait_snapshot()
            else:
                self._lane.abandon()
                self._take_snapshots()
        except Exception as exc:  # noqa: BLE001 - the versions are committed; a snapshot is an optimisation
            log.warning("snapshot not written: %s", exc)
        finally:
            self._pools.close()

    # ----------------------------------------------------------------------------- snapshots
    @property
    def snapshot_in_flight(self) -> int | None:
        """The version a background snapshot is being written for, or None."""
        return self._lane.busy

    @property
    def snapshot_bytes_written(self) -> int:
        """Bytes every background snapshot of this publisher uploaded (committed or not)."""
        return self._lane.bytes_written

    @property
    def last_start(self) -> int:
        """The newest version a late joiner can start from (committed snapshot or full version; 0: none)."""
        self._take_snapshots()
        return self._start

    def wait_snapshot(self, timeout: float | None = None) -> int:
        """Wait for the snapshot in flight (and one asked for meanwhile) to end; returns the newest
        start (committed snapshot or full version). Raises the snapshot's error if it failed."""
        if not self._lane.wait(timeout):
            raise TimeoutError(f"snapshot of version {self._lane.busy} still in flight after {timeout}s")
        failed = self._take_snapshots()
        if failed is None and self._want_snapshot and self._base is not None and self._start < self.version:
            self._start_snapshot()
            return self.wait_snapshot(timeout)
        if failed is not None:
            raise failed
        return self._start

    def _take_snapshots(self) -> BaseException | None:
        """Account the snapshots that ended; returns the error of the newest that failed, if any."""
        failed: BaseException | None = None
        for res in self._lane.take():
            if res.error is not None:
                failed = res.error
                continue
            self._snapshot_committed(res.version, res.bytes_written)
        return failed

    def _snapshot_committed(self, version: int, nbytes: int) -> None:
        """A snapshot of ``version`` (``nbytes`` uploaded) committed: the newest start, if it is newer."""
        if version > self._start:
            self._start, self._start_bytes = version, nbytes
            self._chain = [(v, b) for v, b in self._chain if v > version]

    def _account(self, info: PublishInfo) -> None:
        """The cadence's state after version ``info`` committed (a full version is the newest start)."""
        if info.kind == "keyframe":
            self._start, self._start_bytes, self._chain = info.version, info.bytes_written, []
        else:
            self._chain.append((info.version, info.bytes_written))

    def _snapshot_due(self) -> bool:
        """Whether the newest version needs a snapshot: one was asked for, or the delta chain since
        the newest start outgrew ``snapshot_chain_fraction`` of it."""
        chain = sum(b for _v, b in self._chain)
        return self._start < self.version and (self._want_snapshot or chain > self.chain_fraction * self._start_bytes)

    def _maybe_snapshot(self, asked: bool) -> bool:
        """Start a snapshot of the newest version if the cadence says so (or ``asked``) and the
        lane is free; returns whether one started."""
        self._take_snapshots()
        self._want_snapshot = self._want_snapshot or asked
        if self._lane.busy is not None or self._base is None or not self._snapshot_due():
            return False
        self._start_snapshot()
        return True

    def _start_snapshot(self) -> None:
        assert self._base is not None
        self._want_snapshot = False
        nbytes = {n: int(self._base[n].nbytes) for n, _dt, _shape in self._sig}
        self._lane.start(SnapshotJob(self.version, self._base, list(self._sig), nbytes,
                                     {n: list(d) for n, d in self._digests.items()}, dict(self._files),
                                     dict(self._meta)))

    # ------------------------------------------------------------------------------- publish
    def publish(
        self,
        tensors: dict[str, "torch.Tensor"],
        *,
        files: dict[str, bytes] | None = None,
        meta: dict[str, Any] | None = None,
        snapshot: bool = False,
    ) -> PublishInfo:
        """Publish ``tensors`` as the next version (a delta, or full when there is no base); returns
        what was written.

        ``files`` are side files (e.g. ``config.json``) stored once by content; ``meta`` is free-form
        JSON kept in the manifest; ``snapshot=True`` asks for a background snapshot of this version
        (of the next one, if a snapshot is in flight). Python's cyclic garbage collector is held
        off meanwhile (:func:`infra.gcpause.deferred_gc`).
        """
        with deferred_gc():
            self._lane.wait_copied()  # the base is about to change: a memory copy, never an upload
            self._lane.hold()
            try:
                info = self._publish_version(tensors, files, meta, full=False)
            finally:
                self._lane.release()
            if info.kind == "keyframe":
                self._take_snapshots()
            self._account(info)
            info.snapshot_started = self._maybe_snapshot(snapshot)
            if self.keep_versions:
                collect(self.store, self.prefix, self.keep_versions, busy=self._lane.busy)
            return info

    def republish(self, tensors: dict[str, "torch.Tensor"], *, files: dict[str, bytes] | None = None,
                  meta: dict[str, Any] | None = None) -> PublishInfo:
        """Write the newest version again, as a full version of ``tensors``, after a reader found one
        of its objects corrupt or missing.

        ``tensors`` must be the weights that version holds (the trainer republishes while it still
        holds them). The version number stays, so a run's step -> version mapping and the versions
        its checkpoints record are unchanged. A snapshot in flight is abandoned first. The manifest
        is deleted first (the version is uncommitted while it is rewritten: a reader sees it as not
        yet published, never half rewritten), then every object of the version (its snapshot
        included); the full version is written with its manifest last. The next version is a delta
        on it.
        """
        if self.version < 1:
            raise VersionNotFound("nothing was published, so nothing can be republished", version=None)
        self._drop_newest(delete=True)
        self._take_snapshots()
        with deferred_gc():
            info = self._publish_version(tensors, files, meta, full=True)
        self._start, self._start_bytes, self._chain = info.version, info.bytes_written, []
        return info

    def _drop_newest(self, delete: bool) -> None:
        """Abandon the snapshot in flight and forget the newest version, which the next publish
        writes again as a full one. With ``delete`` its objects go first, the manifest before the
        rest: a reader sees the version as not yet published, never half rewritten."""
        self._lane.abandon()
        if delete:
            self.store.delete(manifest_key(self.prefix, self.version))
            for key in self.store.list(version_dir(self.prefix, self.version) + "/"):
                self.store.delete(key)
        self.version -= 1
        self._forget_base()

    def _forget_base(self) -> None:
        """The base is unknown (a failed or dropped version): the next version is full."""
        self._base, self._sig, self._digests = None, [], {}
        self._hot.clear()

    def _publish_version(
        self,
        tensors: dict[str, "torch.Tensor"],
        files: dict[str, bytes] | None,
        meta: dict[str, Any] | None,
        full: bool,
    ) -> PublishInfo:
        t0 = time.perf_counter()
        version = self.version + 1
        names = list(tensors)
        words = {n: tensor_words(tensors[n]) for n in names}
        sig = [(n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in names]
        for n, dt, _shape in sig:
            if dt not in DTYPE_SIZES:
                raise IncompatibleTensors(f"dtype {dt} cannot be synced (known: {', '.join(DTYPE_SIZES)})",
                                          version=version, tensor=n)
        has_base = not full and self._base is not None and sig == self._sig
        if self._base is not None and sig != self._sig:
            log.info("version %d: tensor names/shapes/dtypes changed; writing a full version", version)
        base = self._base if has_base else None
        self._base = None  # unknown until this publish commits
        if base is None:
            self._hot.clear()
        try:
            info, new_base = self._publish(version, names, tensors, words, sig, base, base is None, files, meta, t0)
        except BaseException:
            self._forget_base()
            raise
        self._base = new_base
        self._meta = dict(meta or {})
        return info

    def _publish(
        self,
        version: int,
        names: list[str],
        tensors: dict[str, "torch.Tensor"],
        words: dict[str, np.ndarray],
        sig: list[tuple[str, str, tuple[int, ...]]],
        base: dict[str, np.ndarray] | None,
        is_key: bool,
        files: dict[str, bytes] | None,
        meta: dict[str, Any] | None,
        t0: float,
    ) -> tuple[PublishInfo, dict[str, np.ndarray]]:
        """Encode and upload every chunk, then commit ``version`` by writing its manifest.

        Returns what was done and the new base (``base`` itself, updated in place, for a delta).
        On any failure, work still running on the pools is settled before the error propagates,
        so nothing writes to the new base afterwards."""
        vdir = version_dir(self.prefix, version)
        pending: deque[Future] = deque()  # shard (and marker) uploads
        window: deque[tuple[list, Future]] = deque()  # encode tasks in flight
        io = self._pools.get("io", self.io_threads)
        try:
            kshards = Shards(self.store, vdir, "k" + self.part, self.shard_bytes, io, pending)
            dshards = Shards(self.store, vdir, "d" + self.part, self.delta_shard_bytes, io, pending)
            new_base = base if base is not None else {n: np.empty_like(words[n]) for n in names}
            entries, changed, total = self._encode(names, words, base, new_base, is_key, window, kshards, dshards,
                                                   pending)
            kshards.flush()
            if dshards.size <= self.carry_bytes:  # uploaded with the manifest: one PUT fewer at the end
                tail = dshards.take_tail(TAIL_SHARD)
            else:
                tail = b""
                dshards.flush()
            if is_key:  # the full-version marker goes up with the last shards (before the manifest)
                pending.append(io.submit(self.store.put, f"{vdir}/{KEYFRAME_MARK}", b""))
            file_digests, file_bytes = self._put_files(files or {})
            # the manifest is built while the last shards upload; it is written after they all are
            man = self._manifest(version, is_key, base is not None, names, sig, tensors, entries, kshards,
                                 dshards, file_digests, meta, tail)
            while pending:
                pending.popleft().result()
            written = kshards.written + dshards.written + file_bytes
        except BaseException:
            settle([f for _, f in window] + list(pending))  # nothing may still write to new_base
            raise
        written += self._commit(man)
        self.version = version
        self._sig = sig
        self._digests = {n: [c.h for c in entries[n]] for n in names}
        self._files = file_digests
        info = PublishInfo(
            version=version,
            kind="keyframe" if is_key else "delta",
            bytes_written=written,
            raw_bytes=sum(t.nbytes for t in man.tensors),
            seconds=time.perf_counter() - t0,
            changed_fraction=(changed / total) if total else 0.0,
        )
        return info, new_base

    def _encode(
        self,
        names: list[str],
        words: dict[str, np.ndarray],
        base: dict[str, np.ndarray] | None,
        new_base: dict[str, np.ndarray],
        is_key: bool,
        window: deque[tuple[list, Future]],
        kshards: Shards,
        dshards: Shards,
        pending: deque[Future],
    ) -> tuple[dict[str, list[ChunkEntry]], int, int]:
        """Encode every chunk on the encode pool and add its frames to the shards, in chunk order.

        At most ``2 * threads`` tasks are in ``window`` (the caller settles them on failure) and
        at most ``2 * io_threads`` shard uploads in ``pending``. Returns the chunk entries per
        tensor, the words that changed and the words in all."""
        cpu = self._pools.get("enc", self.threads)
        jobs = []
        for n in names:
            w = words[n]
            for ci, (s, e) in enumerate(chunk_bounds(len(w), w.dtype.itemsize, self.chunk_bytes)):
                jobs.append((n, ci, s, e))
        entries: dict[str, list[ChunkEntry]] = {n: [] for n in names}
        changed = total = 0
        # a delta chunk is ~0.2 ms of kernel: hand them out a few at a time, so the futures and
        # the GIL-holding bookkeeping per task do not rival the work (keyframe chunks: one each)
        group = 1 if is_key or base is None else DELTA_TASK_CHUNKS
        it = iter([jobs[i : i + group] for i in range(0, len(jobs), group)])

        def job(n: str, ci: int, s: int, e: int) -> EncodedChunk:
            cur = new_base[n][s:e]
            return encode_chunk(
                cur if base is not None else None, words[n][s:e], keyframe=is_key, codec=self.codec,
                level=self.level, prev_digest=self._digests[n][ci] if base is not None else None,
                update_base=cur, hot=self._hot.chunk((n, ci), cur) if base is not None else None,
            )

        def task(specs: list[tuple[str, int, int, int]]) -> list[EncodedChunk]:
            return [job(*spec) for spec in specs]

        def submit_next() -> bool:
            specs = next(it, None)
            if specs is None:
                return False
            window.append((specs, cpu.submit(task, specs)))
            return True

        for _ in range(2 * self.threads):
            if not submit_next():
                break
        while window:
            specs, fut = window.popleft()
            results = fut.result()
            submit_next()
            for (n, ci, s, e), res in zip(specs, results):
                entry = ChunkEntry(res.digest)
                if res.key is not None:
                    entry.k = kshards.add(res.key, res.key_h)
                if res.delta is not None:
                    entry.d = dshards.add(res.delta, res.delta_h)
                entries[n].append(entry)
                changed += res.changed
                total += e - s
            while len(pending) > 2 * self.io_threads:
                pending.popleft().result()
        return entries, changed, total

    def _manifest(
        self,
        version: int,
        is_key: bool,
        has_base: bool,
        names: list[str],
        sig: list[tuple[str, str, tuple[int, ...]]],
        tensors: dict[str, "torch.Tensor"],
        entries: dict[str, list[ChunkEntry]],
        kshards: Shards,
        dshards: Shards,
        file_digests: dict[str, str],
        meta: dict[str, Any] | None,
        tail: bytes,
    ) -> Manifest:
        """The manifest of ``version``: keyframe shards first, then delta shards, whose indices in
        ``entries`` (per kind) are shifted to index the manifest's one list of shards."""
        key_shards = len(kshards.names)
        man = Manifest(
            version=version,
            keyframe=is_key,
            base=(version - 1) if has_base else None,
            chunk_bytes=self.chunk_bytes,
            shards=kshards.names + dshards.names,
            shard_sizes=kshards.sizes + dshards.sizes,
            tensors=[
                TensorEntry(n, s[1], list(s[2]), int(tensors[n].element_size() * tensors[n].numel()),
                            tensor_digest(n, s[1], list(s[2]), [c.h for c in entries[n]]), entries[n])
                for n, s in zip(names, sig)
            ],
            files=file_digests,
            meta=dict(meta or {}),
            tail=tail,
        )
        for t in man.tensors:
            for c in t.chunks:
                if c.d is not None:
                    c.d = [c.d[0] + key_shards, *c.d[1:]]
        return man

    def _commit(self, man: Manifest) -> int:
        """Write the manifest of a version whose every shard is durable (the commit point); returns
        its bytes. (A part of a sharded publish hands it to the committer instead: parts.py.)"""
        blob = man.to_bytes()
        self.store.put(manifest_key(self.prefix, man.version), blob)
        return len(blob)

    def _put_files(self, files: dict[str, bytes]) -> tuple[dict[str, str], int]:
        out: dict[str, str] = {}
        written = 0
        for name, data in files.items():
            h = digest(data)
            if h not in self._files.values() and not self.store.exists(files_key(self.prefix, h)):
                self.store.put(files_key(self.prefix, h), data)
                written += len(data)
            out[name] = h
        return out, written

