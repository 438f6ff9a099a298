"""Reading weight versions: plan a replay, then download, decode and verify in a pipeline.

A fetch of version ``T`` picks the cheapest intact path:

1. from the caller's tensors at ``have_version`` ``h``: apply the delta frames of ``h+1..T``;
2. else from the newest start ``k <= T`` (then older ones): a full version or a committed snapshot
   (:mod:`infra.weightsync.layout`), its keyframe frames, then the deltas ``k+1..T``. A snapshot's
   tensor digests must equal its version's (else :class:`ManifestError` on the snapshot, and the
   next start is tried), so a snapshot cannot stand in for other weights.

Deltas are folded per chunk: every chunk is one buffer that each version's frame patches in place,
so replaying nine deltas costs nine small scatters, not nine model copies. After every frame the
chunk's xxh3-128 digest is checked against that version's manifest. When a patch of the caller's
tensors fails that check, the caller's original chunk is hashed against version ``h`` to tell a
wrong base (:class:`WrongBase`) from corrupt data (:class:`CorruptData`); chunks no delta touched
are verified against the target at the end. A failure in one path (missing, truncated or
corrupted object, wrong base) is recorded in ``last_errors`` and the next path is tried (one version
behind, path 1 runs before any listing: see :meth:`VersionReader._next_version`); with
``strict=True`` the first error is raised instead. Every error names the version and the store
object that failed (``key``). A path through an object already seen to fail is not tried again.

Staleness is the caller's decision, never a silent fallback: when no path reaches the version asked
for (by default the newest committed one), the first fault is raised. Only a caller that passes
``allow_older=True`` without a target gets the newest *older* version that verifies (tried newest
first, at most ``max_fallbacks`` of them; the version is the second element of the result and the
faults that skipped the newer ones are in ``last_errors``). ``deltaloop sync fetch --allow-older``
is such a caller; the rollout worker is not (it keeps the version it serves).

Every manifest is checked when it is read (:mod:`infra.weightsync.validate`): sizes, counts,
offsets and names, and a total of at most ``max_bytes`` (default: this machine's memory), so a
crafted version is a :class:`ManifestError` (handled like any other fault above), never an
allocation it asked for. Every frame's digest is checked before the frame is decoded.

Pipeline and memory bound (:mod:`infra.weightsync.schedule`): frames are fetched as byte ranges of
shards (adjacent frames merged up to ``range_bytes``, default 8 MiB; ranged GETs in parallel on
``io_threads``), at most ``budget_bytes`` (default 256 MiB) of downloaded-but-not-yet-applied data
at a time; a range is decoded by ``threads`` workers as soon as it arrives and all earlier versions
are applied. Peak memory is the output tensors (one model; none extra with ``inplace=True``) +
``budget_bytes`` + per worker about three chunk sizes (4 MiB chunks) of decode temporaries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from infra.gcpause import deferred_gc
from infra.storage import ObjectNotFound
from infra.weightsync.chunks import ChecksumMismatch, apply_frame
from infra.weightsync.errors import (
    CorruptData,
    IncompatibleTensors,
    ManifestError,
    MissingObject,
    VersionNotFound,
    WeightSyncError,
    WrongBase,
)
from infra.weightsync.layout import (
    TAIL_SHARD,
    Listing,
    Manifest,
    digest,
    files_key,
    manifest_key,
    read_manifest_object,
    scan_versions,
    snapshot_key,
    version_dir,
)
from infra.weightsync.pools import Pools
from infra.weightsync.rawbytes import dtype_from_name, tensor_bytes, word_dtype, word_width
from infra.weightsync.reader_tensors import check_dtypes, check_have, chunk_ranges, fetched_tensors, verify_untouched
from infra.weightsync.recovery import bad_parts, viable
from infra.weightsync.schedule import Arrived, Decode, DecodePipeline, Range, Step, counting, plan_ranges
from infra.weightsync.tailstream import StreamedTail, open_manifest
from infra.weightsync.validate import default_max_bytes
from infra.weightsync.warmup import warm_up

if TYPE_CHECKING:
    import torch

    from infra.storage import ObjectStore

log = logging.getLogger(__name__)


_PREFETCH = ThreadPoolExecutor(2, "ws-manifest")  # shared by readers: early manifest reads


#: The reader's manifest cache keeps at most this many versions and this many bytes of the delta
#: frames their manifest objects carry.
MANIFEST_CACHE_VERSIONS = 64
MANIFEST_CACHE_BYTES = 64 << 20


class VersionReader:
    """Reads committed versions under ``prefix`` (any number of readers, concurrently with a writer)."""

    def __init__(
        self,
        store: "ObjectStore",
        prefix: str,
        threads: int = 2,
        *,
        io_threads: int = 8,
        range_bytes: int = 8 << 20,
        budget_bytes: int = 256 << 20,
        strict: bool = False,
        max_fallbacks: int = 3,
        max_bytes: int | None = None,
        names: Collection[str] | None = None,
    ) -> None:
        """``max_bytes``: the most tensor bytes a version may declare (default: this machine's
        memory); a manifest over it is a :class:`ManifestError`. ``names``: fetch only these tensors
        (e.g. the layers one pipeline stage serves): only their frames are downloaded and decoded."""
        warm_up()  # compile/load the codec kernels now, not inside a timed publish/fetch
        self.store, self.prefix = store, prefix.strip("/")
        self.threads, self.io_threads = max(1, threads), max(1, io_threads)
        self.range_bytes, self.budget_bytes = range_bytes, budget_bytes
        self.strict, self.max_fallbacks = strict, max_fallbacks
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.names = frozenset(names) if names is not None else None
        self._progress: Callable[[int, int], None] | None = None  # of the fetch under way
        self._manifests: dict[int, Manifest] = {}
        self._snapshots: dict[int, Manifest] = {}  # snapshot manifests, checked against their version's
        self.last_errors: list[WeightSyncError] = []
        self.last_stats: dict[str, object] = {}
        self._pools = Pools(self)  # download and decode threads, made once

    # ------------------------------------------------------------------------------ listing
    def _scan(self) -> Listing:
        return scan_versions(self.store.list(self.prefix + "/"))

    def close(self) -> None:
        """Stop this reader's download and decode threads (a later fetch starts new ones)."""
        self._pools.close()

    def versions(self) -> list[int]:
        """Committed versions, oldest first."""
        return self._scan().committed

    def starts(self) -> list[int]:
        """Versions a late joiner can start from (full versions and committed snapshots), oldest first."""
        return sorted(self._scan().starts)

    def latest(self) -> int | None:
        """Newest committed version (its manifest exists), or None."""
        committed = self.versions()
        return committed[-1] if committed else None

    def manifest(self, version: int) -> Manifest:
        """The manifest of a committed version (cached; a version a fetch failed on is dropped from the
        cache, since it may be republished)."""
        man = self._manifests.get(version)
        if man is None or (isinstance(man.tail, StreamedTail) and man.tail.failed):
            key = manifest_key(self.prefix, version)
            try:  # returned once its JSON is in; carried frames may still be arriving
                man = open_manifest(self.store, self.prefix, version, self.max_bytes,
                                    self._pools.get("tail", self.io_threads))
            except ObjectNotFound:
                raise VersionNotFound("not committed (no manifest) or collected", version=version) from None
            except WeightSyncError as exc:
                raise exc.at(key) from None
            self._manifests[version] = man
            cache = self._manifests  # the oldest go first; each carries its last delta frames (< a delta shard)
            while len(cache) > 1 and (len(cache) > MANIFEST_CACHE_VERSIONS
                                      or sum(len(m.tail) for m in cache.values()) > MANIFEST_CACHE_BYTES):
                cache.pop(next(iter(cache)))
        return man

    def snapshot(self, version: int) -> Manifest:
        """The manifest of the committed snapshot of ``version`` (cached), checked against the
        version's own manifest: same chunk size, tensors and tensor digests."""
        man = self._snapshots.get(version)
        if man is None:
            key = snapshot_key(self.prefix, version)
            try:
                data = read_manifest_object(self.store, self.prefix, version, snapshot=True)
                man = Manifest.from_bytes(data, version, self.max_bytes, snapshot=True)
            except ObjectNotFound:
                raise VersionNotFound("no committed snapshot (or collected)", version=version, key=key) from None
            except WeightSyncError as exc:
                raise exc.at(key) from None
            own = self.manifest(version)
            if (man.chunk_bytes != own.chunk_bytes or man.signature() != own.signature()
                    or [t.h for t in man.tensors] != [t.h for t in own.tensors]):
                raise ManifestError("the snapshot's tensors are not its version's", version=version, key=key)
            if len(self._snapshots) > 8:
                self._snapshots.pop(next(iter(self._snapshots)))
            self._snapshots[version] = man
        return man

    def _start_manifest(self, version: int, full: set[int]) -> Manifest:
        """What a replay from ``version`` starts with: its own manifest if it is a full version,
        else its snapshot's."""
        return self.manifest(version) if version in full else self.snapshot(version)

    def _check_names(self, version: int) -> None:
        """Raise :class:`IncompatibleTensors` when ``version`` lacks a tensor of ``names`` (the caller's
        error, raised as it is; a manifest that cannot be read is left to the fetch's paths)."""
        if self.names is not None:
            try:
                man = self.manifest(version)
            except WeightSyncError:
                return
            self._view(man)

    def _view(self, man: Manifest) -> Manifest:
        """``man`` with only the tensors this reader fetches (all of them without ``names``)."""
        if self.names is None:
            return man
        if missing := self.names - {t.name for t in man.tensors}:
            raise IncompatibleTensors(f"no tensor {sorted(missing)[0]!r} in this version", version=man.version)
        return replace(man, tensors=[t for t in man.tensors if t.name in self.names])

    def _next_version(self, have_version: int, probe_newer: bool) -> tuple[int | None, Future | None]:
        """``(have_version + 1, probe)`` if that version is committed, else ``(None, None)``.

        Reads its manifest (cached for the fetch) while, in parallel, ``probe`` (when
        ``probe_newer``) HEADs the manifest of ``have_version + 2``. A publisher commits versions
        in order (a version's manifest only after the previous one's), so if the probe finds none,
        ``have_version + 1`` was the newest committed version at that moment, as a listing would
        have said. The caller does not wait for the probe before starting: it checks it once the
        version is applied (:meth:`_newer_committed`).
        """
        nv = have_version + 1
        newer = _PREFETCH.submit(self.store.exists, manifest_key(self.prefix, nv + 1)) if probe_newer else None
        try:
            self.manifest(nv)
        except WeightSyncError:
            if newer is not None:
                newer.cancel()
            return None, None
        return nv, newer

    @staticmethod
    def _newer_committed(probe: Future | None) -> bool:
        """Did the probe of :meth:`_next_version` find a newer version (or fail, so we cannot tell)?"""
        if probe is None:
            return False
        try:
            return bool(probe.result())
        except Exception:  # storage error on the probe: let a listing decide
            return True

    def files(self, version: int) -> dict[str, bytes]:
        """Side files (e.g. ``config.json``) stored with ``version``, verified by digest (each at
        most ``max_bytes``, checked before it is read)."""
        out: dict[str, bytes] = {}
        for name, h in self.manifest(version).files.items():
            key = files_key(self.prefix, h)
            try:
                size = self.store.size(key)
                if size > self.max_bytes:
                    raise CorruptData(f"side file {name!r} has {size} bytes, over max_bytes", version=version, key=key)
                data = self.store.get(key)
            except ObjectNotFound:
                raise MissingObject(f"side file {name!r} is missing", version=version, key=key) from None
            if digest(data) != h:
                raise CorruptData(f"side file {name!r} checksum mismatch", version=version, key=key)
            out[name] = data
        return out

    # -------------------------------------------------------------------------------- fetch
    def fetch(
        self,
        target: int | None = None,
        have: dict[str, "torch.Tensor"] | None = None,
        have_version: int | None = None,
        *,
        inplace: bool = False,
        allow_older: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[dict[str, "torch.Tensor"], int]:
        """Return ``(tensors, version)`` for ``target`` (default: the newest committed version).

        ``have``/``have_version``: the caller's tensors at that version, so only later deltas are
        downloaded. ``have`` is not modified unless ``inplace=True`` (then it is patched and returned;
        after a failed fetch it may hold a mix of versions and must not be passed as ``have`` again).
        When no path reaches the version asked for, the first fault is raised (naming version and
        object), unless ``allow_older`` and no ``target``: then the newest older version that
        verifies is returned (see :meth:`_fetch`). ``progress(bytes done, bytes in all)`` hears of each
        downloaded range of the replay under way (a path tried after a failed one starts again at 0).
        Python's cyclic garbage collector is held off meanwhile (:func:`infra.gcpause.deferred_gc`).
        """
        self._progress = progress
        try:
            with deferred_gc():
                return self._fetch(target, have, have_version, inplace, allow_older)
        finally:
            self._progress = None

    def _fetch(
        self,
        target: int | None,
        have: dict[str, "torch.Tensor"] | None,
        have_version: int | None,
        inplace: bool,
        allow_older: bool,
        one_behind_path: bool = True,
    ) -> tuple[dict[str, "torch.Tensor"], int]:
        """Fast path one version ahead of ``have`` (no listing), else plan from a listing.

        The newest committed version (or ``target``) is tried on every path (the caller's tensors,
        then up to ``max_fallbacks`` keyframes). Only with ``allow_older`` and no ``target`` are
        older versions tried next, newest first, up to ``max_fallbacks`` of them; a path through an
        object already seen to fail (:mod:`infra.weightsync.recovery`) is skipped, so one corrupt
        object costs one failed attempt, not one per older version."""
        t0 = time.perf_counter()
        self.last_errors = []
        bad: dict[int, set[str]] = {}  # version -> frames seen to fail ("k", "d"): see recovery.bad_parts
        have_ok = have is not None and have_version is not None
        if one_behind_path and have_ok and (target is None or int(target) == have_version + 1):
            done, have_ok = self._fetch_next(target, have, have_version, inplace, allow_older, bad, t0)  # type: ignore[arg-type]
            if done is not None:
                return done
        listing = self._scan()
        committed, full = listing.committed, listing.full
        explicit = target is not None
        if not committed:
            raise VersionNotFound(f"no committed version under {self.prefix}/ in this store",
                                  version=int(target) if explicit else None)
        goal = int(target) if explicit else committed[-1]
        if goal not in committed:
            raise VersionNotFound(f"not committed (newest is {committed[-1]})", version=goal)
        self._check_names(goal)
        goals = [goal]
        if allow_older and not explicit:
            goals += [v for v in reversed(committed) if v < goal]
        cset, keys = set(committed), sorted(listing.starts, reverse=True)
        tried_older = 0
        for goal_v in goals:
            if goal_v != goal and tried_older >= self.max_fallbacks:
                break
            plans: list[int | None] = [None] if have_ok and have_version is not None and have_version <= goal_v else []
            plans += [k for k in keys if k <= goal_v][: self.max_fallbacks]
            plans = [k for k in plans if viable(bad, goal_v, have_version if k is None else k, k is not None)]
            tried_older += bool(plans) and goal_v != goal
            for key in plans:
                try:
                    steps = self._chain(goal_v, have_version if key is None else key, cset)
                    out = self._run(goal_v, key, steps, have if key is None else None, have_version, inplace, full)
                except WeightSyncError as exc:
                    if self.strict:
                        raise
                    log.warning("weight fetch path %s -> %d failed: %s", "have" if key is None else
                                f"start {key}", goal_v, exc)
                    self.last_errors.append(exc)
                    bad_parts(bad, exc)
                    self._forget(goal_v, exc.version)
                    if key is None and (inplace or isinstance(exc, WrongBase)):
                        have_ok = False  # patched (or not the version claimed): not a base any more
                    continue
                self.last_stats["seconds"] = time.perf_counter() - t0
                self.last_stats["path"] = "have" if key is None else (
                    f"keyframe {key}" if key in full else f"snapshot {key}")
                self.last_stats["newest"] = goal  # the version asked for (newest committed, or target)
                return out, goal_v
        if self.last_errors:
            raise self.last_errors[0]
        raise VersionNotFound("no full version or committed snapshot at or below it and no usable base",
                              version=goal)

    def _forget(self, *versions: int | None) -> None:
        """Drop the cached manifests of versions a fetch failed on: a version repaired by
        :meth:`~infra.weightsync.publisher.VersionPublisher.republish` has a new manifest under the
        same number."""
        for v in versions:
            if v is not None:
                self._manifests.pop(int(v), None)
                self._snapshots.pop(int(v), None)

    def _fetch_next(
        self,
        target: int | None,
        have: dict[str, "torch.Tensor"],
        have_version: int,
        inplace: bool,
        allow_older: bool,
        bad: dict[int, set[str]],
        t0: float,
    ) -> tuple[tuple[dict[str, "torch.Tensor"], int] | None, bool]:
        """The usual case, one version ahead of the caller: no listing. Reads that manifest and, when
        no target was given, checks that the next one does not exist (versions are committed in
        order, so then it is the newest), both at once: one round trip instead of list + manifest.

        Returns ``(result or None, whether have is still a usable base)``."""
        goal1, probe = self._next_version(have_version, probe_newer=target is None)
        if goal1 is not None and probe is not None and probe.done() and self._newer_committed(probe):
            goal1 = None  # already known to be behind by more than one: list and fold instead
        if goal1 is None:
            return None, True
        try:
            self._chain(goal1, have_version, {goal1})
            out = self._run(goal1, None, [goal1], have, have_version, inplace, set())
        except WeightSyncError as exc:
            if self.strict:
                raise
            log.warning("weight fetch path have -> %d failed: %s", goal1, exc)
            self.last_errors.append(exc)
            bad_parts(bad, exc)
            self._forget(goal1, exc.version)
            return None, not inplace and not isinstance(exc, WrongBase)
        if self._newer_committed(probe):
            # the store moved on while this version was applied (or the probe failed): list, and
            # fold the deltas after it in one pass; ``out`` is the caller's tensors (inplace) or ours
            return self._fetch(None, out, goal1, True, allow_older, one_behind_path=False), True
        self.last_stats["seconds"] = time.perf_counter() - t0
        self.last_stats["path"] = "have"
        self.last_stats["newest"] = goal1
        return (out, goal1), True

    def _chain(self, goal: int, start: int | None, committed: set[int]) -> list[int]:
        """Delta versions to apply after ``start`` to reach ``goal`` (checks they exist and chain)."""
        assert start is not None
        steps = list(range(start + 1, goal + 1))
        for v in steps:
            if v not in committed:
                raise VersionNotFound("missing in the delta chain", version=v)
            man = self.manifest(v)
            if man.base != v - 1:
                raise VersionNotFound(f"has no delta against version {v - 1}", version=v)
        return steps

    # ------------------------------------------------------------------------- execution
    def _run(
        self,
        goal: int,
        key: int | None,
        deltas: list[int],
        have: dict[str, "torch.Tensor"] | None,
        have_version: int | None,
        inplace: bool,
        full: set[int],
    ) -> dict[str, "torch.Tensor"]:
        """Replay to ``goal``: the start ``key`` (a version in ``full``, else its snapshot; or the
        caller's tensors ``have`` at ``have_version``), then the frames of ``deltas``, into new
        buffers (into ``have`` with ``inplace``). Every decoded chunk is verified against its
        version's digest, every chunk no frame touched against ``goal``'s."""
        start_v = key if key is not None else have_version
        assert start_v is not None
        start = self._view(self._start_manifest(key, full) if key is not None else self.manifest(start_v))
        final = self._view(self.manifest(goal))
        self._check_chain_layout(start, deltas)
        tensors = start.tensors
        check_dtypes(tensors, start_v)
        bounds = [chunk_ranges(t.dtype, t.nbytes, start.chunk_bytes) for t in tensors]
        if have is not None:  # check the caller's tensors before anything is downloaded
            check_have(have, tensors, start_v)
        steps: list[Step] = []
        if key is not None:
            steps.append((key, "k", start))
        steps += [(v, "d", self._view(self.manifest(v))) for v in deltas]
        ranges = self._plan(steps, key is not None and key not in full)
        self.last_stats = {"bytes_read": sum(r.length for r in ranges), "versions": [s[0] for s in steps]}
        touched = [[False] * len(b) for b in bounds]
        bufs: list[np.ndarray] = []  # the output tensors' bytes, decoded into in place
        words: list[np.ndarray] = []  # the same as words
        origs: list[np.ndarray] = []  # the caller's tensors, when a copy of them is patched

        def prepare() -> None:
            """The buffers to decode into: run while the first ranges download (the copy of a
            non-inplace fetch is a full model, ~20 ms on a 2-core VM)."""
            if have is not None:
                for t in tensors:
                    raw = tensor_bytes(have[t.name])
                    bufs.append(raw if inplace else raw.copy())
                if not inplace:
                    origs.extend(tensor_bytes(have[t.name]) for t in tensors)
            else:
                bufs.extend(np.empty(t.nbytes, np.uint8) for t in tensors)
            words.extend(b.view(word_dtype(word_width(dtype_from_name(t.dtype).itemsize)))
                         for b, t in zip(bufs, tensors))

        def decode(step: int, ti: int, ci: int, frame: memoryview) -> None:
            v, kind, man = steps[step]
            t = man.tensors[ti]
            c = t.chunks[ci]
            s, e = bounds[ti][ci]
            buf = words[ti][s:e]
            first = not touched[ti][ci]
            try:
                apply_frame(frame, buf, c.h, frame_h=(c.k if kind == "k" else c.d)[3])  # type: ignore[index]
            except CorruptData as exc:  # frame digest, malformed frame or checksum mismatch
                why = str(exc)
                key = self._frame_key(v, man, c.k if kind == "k" else c.d)
                if first and kind == "d":  # was the base wrong? (checked only on failure: saves a pass)
                    base_h = self._view(self.manifest(v - 1)).tensors[ti].chunks[ci].h
                    if origs:
                        orig = origs[ti].view(buf.dtype)[s:e]
                        if digest(orig) != base_h:
                            raise WrongBase(f"chunk {ci}: the tensors given are not version {v - 1}",
                                            version=v, tensor=t.name) from None
                    elif isinstance(exc, ChecksumMismatch):  # the in-place base is gone: cannot blame the object
                        why += f" (corrupt data in {key}, or the in-place tensors were not version {v - 1})"
                        key = None
                raise CorruptData(f"chunk {ci} ({kind} frame): {why}", version=v, tensor=t.name, key=key) from exc
            touched[ti][ci] = True

        self._pipeline(ranges, steps, decode).run(prepare)
        verify_untouched(touched, bounds, words, final, have_version, self._pools.get("dec", self.threads))
        return fetched_tensors(tensors, bufs, have, inplace)

    def _pipeline(self, ranges: list[Range], steps: list[Step], decode: Decode) -> DecodePipeline:
        """The downloads and decodes of one replay (its bytes counted for the fetch's ``progress``)."""
        download = partial(self._download, steps=steps)
        if self._progress is not None:
            download = counting(download, sum(r.length for r in ranges), self._progress)
        return DecodePipeline(ranges, len(steps), download, decode, self._pools.get("get", self.io_threads),
                              self._pools.get("dec", self.threads), self.io_threads, self.threads, self.budget_bytes)

    def _plan(self, steps: list[Step], from_snapshot: bool) -> list[Range]:
        """:func:`plan_ranges` of ``steps``; its fault (a keyframe manifest without a chunk's
        keyframe frame) names the manifest object (the snapshot's, when the replay starts from one)."""
        try:
            return plan_ranges(steps, self.prefix, self.range_bytes)
        except WeightSyncError as exc:
            if exc.version is None:
                raise
            snap = from_snapshot and exc.version == steps[0][0]
            raise exc.at(snapshot_key(self.prefix, exc.version) if snap else
                         manifest_key(self.prefix, exc.version)) from None

    def _check_chain_layout(self, start: Manifest, deltas: list[int]) -> None:
        """Every delta version has the tensors and chunk size of the version replayed from, and a
        chunk without a delta frame keeps the previous version's digest (it did not change: only
        then does the digest checked when a frame last touched the chunk hold for the target)."""
        sig = start.signature()
        prev = start
        for v in deltas:
            man = self._view(self.manifest(v))
            key = manifest_key(self.prefix, v)
            if man.signature() != sig or man.chunk_bytes != start.chunk_bytes:
                raise IncompatibleTensors("tensor layout differs from its base", version=v, key=key)
            for t, pt in zip(man.tensors, prev.tensors):
                for ci, (c, pc) in enumerate(zip(t.chunks, pt.chunks)):
                    if c.d is None and c.h != pc.h:
                        raise CorruptData(f"chunk {ci} has no delta frame, yet its digest differs from "
                                          f"version {prev.version}'s", version=v, tensor=t.name, key=key)
            prev = man

    def _download(self, r: Range, arrived: Arrived, steps: list[Step]) -> bytes | memoryview:
        """The bytes of range ``r`` (from the manifest object for inline frames), checked for
        length; ``arrived(n, buf)`` hears of each part that came in before the last (see
        :class:`~infra.weightsync.schedule.DecodePipeline`)."""
        v, _kind, man = steps[r.step]
        first = man.tensors[r.frames[0][0]].name
        if r.carried and isinstance(man.tail, StreamedTail):  # frames arriving with the manifest
            return man.tail.wait(r.start, r.length, arrived)
        if r.carried:  # frames that came with the manifest
            data = man.tail[r.start : r.start + r.length]
            if len(data) != r.length:
                raise CorruptData(f"manifest carries {len(man.tail)} bytes of frames, a frame ends at "
                                  f"{r.start + r.length}", version=v, tensor=first, key=manifest_key(self.prefix, v))
            return data
        whole: bytes | None = None  # the range in one piece (a local store): kept as it is, no copy
        mv: memoryview | None = None
        got = 0
        try:
            for piece in self.store.iter_range(r.key, r.start, r.length):
                n = len(piece)
                if got + n > r.length:
                    raise CorruptData(f"more than the {r.length} bytes asked for at {r.start}",
                                      version=v, tensor=first, key=r.key)
                if n == r.length:
                    whole, got = piece, n
                    continue
                if mv is None:
                    mv = memoryview(bytearray(r.length))
                mv[got : got + n] = piece
                got += n
                if got < r.length:
                    arrived(got, mv)
        except ObjectNotFound:
            raise MissingObject("missing", version=v, tensor=first, key=r.key) from None
        if got != r.length:
            raise CorruptData(f"truncated: got {got} of {r.length} bytes at {r.start}",
                              version=v, tensor=first, key=r.key)
        return whole if whole is not None else mv  # type: ignore[return-value]

    def _frame_key(self, version: int, man: Manifest, loc: object) -> str | None:
        """The store object holding a frame at ``loc`` (``[shard, offset, length, digest]``) of
        ``version``: a shard, or the manifest for the frames it carries."""
        if not isinstance(loc, (list, tuple)) or not loc:
            return None
        shard = man.shards[int(loc[0])]
        return manifest_key(self.prefix, version) if shard == TAIL_SHARD else f"{version_dir(self.prefix, version)}/{shard}"

