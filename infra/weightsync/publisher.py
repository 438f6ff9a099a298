"""Publishing weight versions: encode on a thread pool while finished shards upload.

:class:`VersionPublisher` keeps a private copy of the last published words (the base), so a
delta never depends on what the caller does to its tensors afterwards. After a delta it updates the
base only at the changed positions (a scatter of ~1% of the words instead of a full copy).

Streaming and memory bound: chunks (``chunk_bytes``, default 4 MiB) are encoded by ``threads``
workers with at most ``2 * threads`` tasks in flight (a task is one keyframe chunk, or
``DELTA_TASK_CHUNKS`` delta chunks, whose frames are small); frames are appended in chunk order to
shards of ``shard_bytes`` (default 32 MiB) that upload on ``io_threads`` threads while encoding
continues, with at most ``2 * io_threads`` shards queued. Delta frames go to smaller shards
(``delta_shard_bytes``, default 256 KiB), so a small delta uploads while the rest of the model is
still being encoded rather than as one object after the last chunk (at lr 1e-6 the whole delta is
~0.75 MB, 15 ms of a 50 MB/s link); the last, partly filled delta shard is not uploaded on its own
but carried by the manifest object, so one PUT follows the last chunk. Peak extra memory over the
base copy is therefore about ``2*threads*chunk_bytes*3 + (2*io_threads+2)*shard_bytes`` (~350 MiB
at defaults, only reached by keyframes; a delta at lr 1e-6 is ~0.5% of the model).
A version becomes visible when its manifest is written, after every shard upload succeeded; if
publish fails midway nothing is visible, the base is marked unknown and the next version is a
keyframe.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from infra.gcpause import deferred_gc
from infra.weightsync.chunks import EncodedChunk, encode_chunk
from infra.weightsync.codec import CodecName
from infra.weightsync.errors import IncompatibleTensors, VersionNotFound, WeightSyncError
from infra.weightsync.gc import collect
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
from infra.weightsync.warmup import warm_up

if TYPE_CHECKING:
    import torch

    from infra.storage import ObjectStore

log = logging.getLogger(__name__)

DELTA_TASK_CHUNKS = 4  # chunks per encode task of a delta version


@dataclass
class PublishInfo:
    """What one :meth:`VersionPublisher.publish` did."""

    version: int
    kind: str  # "keyframe" | "delta"
    bytes_written: int
    raw_bytes: int
    seconds: float
    changed_fraction: float


class _Shards:
    """Packs frames into shard objects and uploads full shards in the background."""

    def __init__(self, store: "ObjectStore", vdir: str, tag: str, shard_bytes: int, io: ThreadPoolExecutor,
                 pending: deque[Future]) -> None:
        self.store, self.vdir, self.tag, self.limit = store, vdir, tag, shard_bytes
        self.io, self.pending = io, pending
        self.names: list[str] = []
        self.sizes: list[int] = []  # bytes of each shard
        self.parts: list[bytes] = []
        self.size = 0
        self.written = 0

    def add(self, frame: bytes, frame_h: str) -> list:
        """Append ``frame`` (whose digest is ``frame_h``); returns its ``[shard, offset, length,
        digest]`` (shard index per kind)."""
        if not self.parts:
            self.names.append(f"{self.tag}-{len(self.names):04d}.bin")
            self.sizes.append(0)
        loc = [len(self.names) - 1, self.size, len(frame), frame_h]
        self.parts.append(frame)
        self.size += len(frame)
        self.sizes[-1] = self.size
        if self.size >= self.limit:
            self.flush()
        return loc

    def take_tail(self, name: str) -> bytes:
        """The frames not yet uploaded, as shard ``name`` (carried by the manifest object)."""
        if not self.parts:
            return b""
        self.names[-1] = name
        tail = b"".join(self.parts)
        self.parts, self.size = [], 0
        return tail

    def flush(self) -> None:
        """Upload the frames gathered so far as one shard, in the background."""
        if not self.parts:
            return
        blob = b"".join(self.parts) if len(self.parts) > 1 else self.parts[0]
        key = f"{self.vdir}/{self.names[-1]}"
        self.pending.append(self.io.submit(self.store.put, key, blob))
        self.written += len(blob)
        self.parts, self.size = [], 0


class VersionPublisher:
    """Writes versions 1, 2, ... under ``prefix``: a keyframe every ``keyframe_every``, deltas between.

    Constructed over a store that already holds versions, it continues after the newest committed
    one, reading it back as the base (the first publish is a keyframe if that read fails).
    """

    def __init__(
        self,
        store: "ObjectStore",
        prefix: str,
        keyframe_every: int = 10,
        codec: CodecName = "auto",
        zstd_level: int = 1,
        threads: int = 2,
        *,
        chunk_bytes: int = 4 << 20,
        shard_bytes: int = 32 << 20,
        delta_shard_bytes: int = 256 << 10,
        io_threads: int = 4,
        keep_versions: int = 0,
    ) -> None:
        warm_up()  # compile/load the codec kernels now, not inside a timed publish/fetch
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
        if codec not in ("auto", "xor", "sparse"):
            raise ValueError(f"unknown codec {codec!r}; known: auto, xor, sparse")
        self.store, self.prefix = store, prefix.strip("/")
        self.keyframe_every, self.codec, self.level = keyframe_every, codec, zstd_level
        self.threads, self.chunk_bytes, self.shard_bytes = max(1, threads), chunk_bytes, shard_bytes
        self.delta_shard_bytes = delta_shard_bytes
        self.io_threads, self.keep_versions = max(1, io_threads), keep_versions
        self._base: dict[str, np.ndarray] | None = None  # name -> private copy of words
        self._sig: list[tuple[str, str, tuple[int, ...]]] = []
        self._digests: dict[str, list[str]] = {}
        self._files: dict[str, str] = {}  # side-file name -> digest already stored
        self._hot = HotWords()  # hot-word lists of the base's chunks, kept across versions
        self._pools = Pools(self)  # encode and upload threads, made once
        committed, _keys, seen = scan_versions(store.list(self.prefix + "/"))
        self.version = committed[-1] if committed else 0
        for orphan in sorted(v for v in seen if v > self.version):  # left by a killed publisher
            for key in store.list(version_dir(self.prefix, orphan) + "/"):
                store.delete(key)
        if self.version:
            self._resume()

    def _resume(self) -> None:
        reader = VersionReader(self.store, self.prefix, threads=self.threads)
        try:
            tensors, v = reader.fetch(self.version)
            man = reader.manifest(v)
        except WeightSyncError as exc:
            log.warning("cannot read back version %d as base (%s); next version is a keyframe", self.version, exc)
            return
        if man.chunk_bytes != self.chunk_bytes:
            log.info("version %d used chunk_bytes %d; next version is a keyframe", v, man.chunk_bytes)
            return
        self._base = {k: tensor_words(t).copy() for k, t in tensors.items()}
        self._sig = man.signature()
        self._digests = {t.name: [c.h for c in t.chunks] for t in man.tensors}
        self._files = dict(man.files)

    def close(self) -> None:
        """Stop this publisher's encode and upload threads (a later publish starts new ones)."""
        self._pools.close()

    # ------------------------------------------------------------------------------- publish
    def publish(
        self,
        tensors: dict[str, "torch.Tensor"],
        *,
        files: dict[str, bytes] | None = None,
        meta: dict[str, Any] | None = None,
        keyframe: bool | None = None,
    ) -> PublishInfo:
        """Publish ``tensors`` as the next version (keyframe or delta); returns what was written.

        ``files`` are side files (e.g. ``config.json``) stored once by content; ``meta`` is free-form
        JSON kept in the manifest; ``keyframe=True`` forces a keyframe. Python's cyclic garbage
        collector is held off meanwhile (:func:`infra.gcpause.deferred_gc`).
        """
        with deferred_gc():
            return self._publish_version(tensors, files, meta, keyframe)

    def republish(self, tensors: dict[str, "torch.Tensor"], *, files: dict[str, bytes] | None = None,
                  meta: dict[str, Any] | None = None) -> PublishInfo:
        """Write the newest version again, as a keyframe of ``tensors``, after a reader found one of
        its objects corrupt or missing.

        ``tensors`` must be the weights that version holds (the trainer republishes while it still
        holds them). The version number stays, so a run's step -> version mapping and the versions
        its checkpoints record are unchanged. The manifest is deleted first (the version is
        uncommitted while it is rewritten: a reader sees it as not yet published, never half
        rewritten), then every object of the version; the keyframe is written with its manifest
        last. The next version is a delta on it.
        """
        if self.version < 1:
            raise VersionNotFound("nothing was published, so nothing can be republished", version=None)
        v = self.version
        self.store.delete(manifest_key(self.prefix, v))
        for key in self.store.list(version_dir(self.prefix, v) + "/"):
            self.store.delete(key)
        self.version = v - 1
        self._base, self._sig, self._digests = None, [], {}
        self._hot.clear()
        return self.publish(tensors, files=files, meta=meta, keyframe=True)

    def _publish_version(
        self,
        tensors: dict[str, "torch.Tensor"],
        files: dict[str, bytes] | None,
        meta: dict[str, Any] | None,
        keyframe: bool | None,
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
        has_base = self._base is not None and sig == self._sig
        is_key = bool(keyframe) or not has_base or (version - 1) % self.keyframe_every == 0
        if self._base is not None and not has_base and sig != self._sig:
            log.info("version %d: tensor names/shapes/dtypes changed; writing a keyframe", version)
        base = self._base if has_base else None
        self._base = None  # unknown until this publish commits
        if base is None:
            self._hot.clear()
        try:
            info, new_base = self._publish(version, names, tensors, words, sig, base, is_key, files, meta, t0)
        except BaseException:
            self._sig, self._digests = [], {}
            self._hot.clear()
            raise
        self._base = new_base
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
            kshards = _Shards(self.store, vdir, "k", self.shard_bytes, io, pending)
            dshards = _Shards(self.store, vdir, "d", self.delta_shard_bytes, io, pending)
            new_base = base if base is not None else {n: np.empty_like(words[n]) for n in names}
            entries, changed, total = self._encode(names, words, base, new_base, is_key, window, kshards, dshards,
                                                   pending)
            kshards.flush()
            tail = dshards.take_tail(TAIL_SHARD)  # uploaded with the manifest: one PUT fewer at the end
            if is_key:  # the marker goes up with the last shards (it must exist before the manifest)
                pending.append(io.submit(self.store.put, f"{vdir}/{KEYFRAME_MARK}", b""))
            file_digests, file_bytes = self._put_files(files or {})
            # the manifest is built while the last shards upload; it is written after they all are
            man = self._manifest(version, is_key, base is not None, names, sig, tensors, entries, kshards.sizes,
                                 dshards.names, dshards.sizes, file_digests, meta, tail)
            blob = man.to_bytes()
            while pending:
                pending.popleft().result()
            written = kshards.written + dshards.written + file_bytes
        except BaseException:
            settle([f for _, f in window] + list(pending))  # nothing may still write to new_base
            raise
        self.store.put(manifest_key(self.prefix, version), blob)  # commit point
        written += len(blob)
        self.version = version
        self._sig = sig
        self._digests = {n: [c.h for c in entries[n]] for n in names}
        self._files = file_digests
        if self.keep_versions:
            collect(self.store, self.prefix, self.keep_versions)
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
        kshards: _Shards,
        dshards: _Shards,
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
        key_sizes: list[int],
        delta_shards: list[str],
        delta_sizes: list[int],
        file_digests: dict[str, str],
        meta: dict[str, Any] | None,
        tail: bytes,
    ) -> Manifest:
        """The manifest of ``version``: keyframe shards first, then delta shards, whose indices in
        ``entries`` (per kind) are shifted to index the manifest's one list of shards."""
        key_shards = len(key_sizes)
        shard_names = [f"k-{i:04d}.bin" for i in range(key_shards)]
        man = Manifest(
            version=version,
            keyframe=is_key,
            base=(version - 1) if has_base else None,
            chunk_bytes=self.chunk_bytes,
            shards=shard_names + delta_shards,
            shard_sizes=key_sizes + delta_sizes,
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
