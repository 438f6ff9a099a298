"""Sharded publishing: each trainer rank encodes and uploads the tensors it holds; one manifest
commits them all.

One :class:`~infra.weightsync.publisher.VersionPublisher` on one rank encodes the whole model, so
the publish of a model spread over many trainer nodes is bounded by one node's cores and uplink and
by gathering every tensor to that node first. Here the tensors are dealt to ``parts`` publishers
(:func:`assign_parts`: largest first to the lightest part, so the bytes balance), each on the rank
that holds them, and a version is published in two phases:

1. **Prepare** (every part, in parallel): :meth:`PartPublisher.prepare` encodes the part's tensors
   against its own base and uploads its shards (named with the part's infix:
   ``k-p003-0000.bin``, ``d-p003-0000.bin``), and returns a :class:`PartReport` holding its share of
   the manifest (shard indices local to the part, its last partial delta shard as carried frames)
   instead of writing a manifest. Nothing is visible yet. A part carries at most
   ``delta_shard_bytes / parts`` of frames (a larger last shard it uploads), so the merged manifest
   object carries no more than one publisher's would, however many parts there are.
2. **Commit** (part 0, the committer): :meth:`PartPublisher.commit` merges the shares
   (:func:`merge_parts`: the parts' shard lists concatenated with the indices shifted, their
   carried frames concatenated into the one manifest object) and writes the manifest: the version
   becomes visible at once, with every part's shards durable. If any part failed, nothing is
   written. The :class:`Outcome` goes back to every part (:meth:`PartPublisher.settle`): a part
   whose version did not commit forgets its base, so the next version is full on every part.

A version is a delta only if every part can diff (``ready``: each part has the base of the newest
version and the same tensor layout); the caller gathers :meth:`PartPublisher.ready` from the parts
first and passes ``full`` to all of them, because a reader replays a version's delta frames for
every chunk or its keyframe frames for every chunk.

**Snapshots** follow the same cadence as one publisher's (the committer keeps it: the bytes of the
merged delta chain against the newest start), and each part writes its share in its own background
lane, below its deltas, as ``s-p003-*.bin`` shards and a share manifest (``s-p003-manifest.zst``,
:func:`~infra.weightsync.layout.fragment_key`). A part's report says which of its snapshots ended and
how; the committer writes the snapshot's manifest, merged from every part's share, at the first
commit (or :meth:`PartPublisher.collect_snapshots`) after all of them reported success, so a
snapshot of version N becomes visible with version N+1 or later. A snapshot one part failed is
dropped (its objects are deleted) and the cadence asks for another.

The parts exchange reports and outcomes through the caller (the trainer uses torch.distributed
``gather_object`` / ``broadcast_object_list``: :mod:`infra.train.sharded_publish`); this module
has no collectives of its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from infra.gcpause import deferred_gc
from infra.weightsync.errors import WeightSyncError
from infra.weightsync.gc import clean_orphans, collect, delete_snapshot_objects
from infra.weightsync.layout import (
    TAIL_SHARD,
    ChunkEntry,
    Manifest,
    TensorEntry,
    fragment_key,
    manifest_key,
    part_infix,
    scan_versions,
    snapshot_key,
)
from infra.weightsync.validate import MAX_MANIFEST_OBJECT
from infra.weightsync.publisher import PublishInfo, VersionPublisher
from infra.weightsync.rawbytes import dtype_name

if TYPE_CHECKING:
    import torch

    from infra.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class PartReport:
    """What one part sends the committer (picklable): its share of a version, or why it has none,
    and the snapshots of its lane that ended since its last report."""

    part: int
    version: int  # the version prepared (0: a report of snapshots only)
    manifest: Manifest | None = None  # the share: part-local shard indices, its carried frames as ``tail``
    error: str | None = None
    bytes_written: int = 0  # shard (and side-file) bytes uploaded; carried frames are the committer's
    changed: int = 0
    total: int = 0
    seconds: float = 0.0
    snapshots: list[tuple[int, str | None]] = field(default_factory=list)  # (version, error or None)


@dataclass
class Outcome:
    """The committer's answer to one version's reports, sent back to every part."""

    version: int
    committed: bool
    error: str | None = None
    snapshot: bool = False  # every part starts its share of a snapshot of this version
    info: PublishInfo | None = None


def assign_parts(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """Deal the tensors (name -> bytes) to ``parts`` parts: largest first, each to the part with the
    fewest bytes so far (ties: the lower part); each part's names keep the order of ``sizes``.
    The same input gives the same answer on every rank."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    load = [0] * parts
    owner: dict[str, int] = {}
    order = {n: i for i, n in enumerate(sizes)}
    for name in sorted(sizes, key=lambda n: (-sizes[n], order[n])):
        p = min(range(parts), key=lambda i: (load[i], i))
        owner[name] = p
        load[p] += sizes[name]
    return [[n for n in sizes if owner[n] == p] for p in range(parts)]


def merge_parts(shares: list[Manifest]) -> Manifest:
    """One manifest from the parts' shares of a version (or of a snapshot), in part order: shard
    lists concatenated with each frame's shard index shifted, carried frames concatenated into
    one ``@manifest`` shard (last) with their offsets shifted. Raises ``WeightSyncError`` when the
    shares disagree on the version, its kind or the chunk size. The shares are not changed."""
    first = shares[0]
    for m in shares[1:]:
        if (m.version, m.keyframe, m.base, m.chunk_bytes, m.snapshot) != (
                first.version, first.keyframe, first.base, first.chunk_bytes, first.snapshot):
            raise WeightSyncError("the parts' shares disagree on the version's kind, base or chunk size",
                                  version=first.version)
    shards: list[str] = []
    sizes: list[int] = []
    tails: list[bytes] = []
    tail_off = 0
    tensors = []
    carried: list[list] = []  # frame locations in the merged tail, whose shard index comes last
    for m in shares:
        index = {}
        for i, (name, size) in enumerate(zip(m.shards, m.shard_sizes)):
            if name != TAIL_SHARD:
                index[i] = len(shards)
                shards.append(name)
                sizes.append(size)

        def moved(loc: list | None) -> list | None:
            if loc is None:
                return None
            if m.shards[loc[0]] != TAIL_SHARD:
                return [index[loc[0]], *loc[1:]]
            out = [-1, loc[1] + tail_off, *loc[2:]]  # the shard index is set once the tail's is known
            carried.append(out)
            return out

        for t in m.tensors:
            chunks = [ChunkEntry(c.h, moved(c.k), moved(c.d)) for c in t.chunks]
            tensors.append(TensorEntry(t.name, t.dtype, t.shape, t.nbytes, t.h, chunks))
        tail = bytes(m.tail)
        tails.append(tail)
        tail_off += len(tail)
    if tail_off:
        for loc in carried:
            loc[0] = len(shards)
        shards.append(TAIL_SHARD)
        sizes.append(tail_off)
    return Manifest(version=first.version, keyframe=first.keyframe, base=first.base, chunk_bytes=first.chunk_bytes,
                    shards=shards, tensors=tensors, files=dict(first.files), meta=dict(first.meta),
                    tail=b"".join(tails), shard_sizes=sizes, snapshot=first.snapshot)


class PartPublisher(VersionPublisher):
    """Part ``part`` of ``parts`` of a sharded publish of the tensors ``names`` (module docstring).

    Every part is made over the same store and prefix with the same settings; it continues after the
    newest committed version, reading back its own tensors of it as its base. Part 0 is also the
    committer: it deletes what killed publishers left, keeps the snapshot cadence and writes the
    manifests. The caller must let part 0 finish construction before any part prepares."""

    def __init__(self, store: "ObjectStore", prefix: str, part: int, parts: int, names: list[str],
                 **kwargs: Any) -> None:
        if not 0 <= part < parts:
            raise ValueError(f"part {part} is not one of 0..{parts - 1}")
        self.index, self.parts, self.names = part, parts, list(names)
        self._staged: Manifest | None = None  # the share the last prepare made
        self._snap_reports: dict[int, dict[int, str | None]] = {}  # committer: version -> part -> error
        self._snap_version: int | None = None  # committer: the snapshot the parts are writing
        self._abandoned: int | None = None  # committer: a snapshot dropped by a republish, shares to delete
        super().__init__(store, prefix, part=part_infix(part), **kwargs)
        self.carry_bytes = self.delta_shard_bytes // parts  # the merged manifest carries at most one shard's
        if part == 0:
            clean_orphans(store, self.prefix, scan_versions(store.list(self.prefix + "/")))

    def _resume(self, starts: set[int], names: list[str] | None = None) -> None:
        super()._resume(starts, self.names)

    def _commit(self, man: Manifest) -> int:
        self._staged = man  # the committer writes it, merged with the other parts' shares
        return 0

    def publish(self, *args: Any, **kwargs: Any) -> PublishInfo:
        raise TypeError("a part publishes in two phases: prepare on every part, commit on part 0, settle")

    def republish(self, *args: Any, **kwargs: Any) -> PublishInfo:
        raise TypeError("a part republishes with drop_newest, then prepare(full=True), commit and settle")

    def close(self, wait_snapshot: bool = False) -> None:
        """Stop this part's threads; its snapshot share in flight is abandoned or, with
        ``wait_snapshot``, finished (the committer merges it: :meth:`collect_snapshots`)."""
        try:
            self._lane.wait() if wait_snapshot else self._lane.abandon()
        finally:
            self._pools.close()

    # ----------------------------------------------------------------------------- every part
    def ready(self, tensors: dict[str, "torch.Tensor"]) -> bool:
        """Whether this part can publish ``tensors`` as a delta (it has the newest version's base of
        exactly these names, dtypes and shapes)."""
        sig = [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
        return self._base is not None and sig == self._sig

    def prepare(self, tensors: dict[str, "torch.Tensor"], *, full: bool, files: dict[str, bytes] | None = None,
                meta: dict[str, Any] | None = None) -> PartReport:
        """Encode and upload this part's ``tensors`` as the next version (full on every part when any
        part is not ``ready``); returns the share for the committer. A failure is reported, not
        raised, so the committer hears from every part."""
        t0 = time.perf_counter()
        version = self.version + 1
        self._staged = None
        self._lane.wait_copied()
        self._lane.hold()
        try:
            with deferred_gc():
                info = self._publish_version(tensors, files, meta, full=full)
        except Exception as exc:  # noqa: BLE001 - every part's report reaches the committer
            return PartReport(self.index, version, error=f"part {self.index}: {exc}", snapshots=self._ended())
        finally:
            self._lane.release()
        total = sum(int(t.numel()) for t in tensors.values())
        return PartReport(self.index, version, self._staged, None, info.bytes_written,
                          round(info.changed_fraction * total), total, time.perf_counter() - t0, self._ended())

    def settle(self, outcome: Outcome) -> None:
        """Apply the committer's ``outcome``: a version that did not commit is forgotten (the base
        is unknown: the next version is full); a snapshot asked for starts in the background."""
        if not outcome.committed:
            if self.version == outcome.version:
                self.version -= 1
            self._forget_base()
            return
        if outcome.snapshot and self._base is not None:
            self._start_snapshot()

    def snapshot_report(self, wait: bool = False) -> PartReport:
        """A report of this part's snapshots that ended (first waiting for the one in flight, with
        ``wait``), for :meth:`collect_snapshots`."""
        if wait:
            self._lane.wait()
        return PartReport(self.index, 0, snapshots=self._ended())

    def drop_newest(self) -> None:
        """Forget the newest version before it is written again as a full version (a republish):
        the snapshot in flight is abandoned and part 0 deletes the version's objects, manifest first,
        which must happen before any part prepares it again."""
        self._drop_newest(delete=self.index == 0)
        self._ended()  # shares of an abandoned snapshot: the committer forgets it below
        if self.index == 0:  # shares some parts finished stay until every lane stopped (the next commit)
            self._abandoned, self._snap_version, self._snap_reports = self._snap_version, None, {}

    def _ended(self) -> list[tuple[int, str | None]]:
        return [(r.version, None if r.error is None else str(r.error)[:500]) for r in self._lane.take()]

    # -------------------------------------------------------------------------- the committer
    def commit(self, reports: list[PartReport]) -> Outcome:
        """Part 0: write the manifest merged from every part's share of one version (nothing if any
        part failed); account the parts' snapshots and decide whether a new one starts."""
        if self.index != 0:
            raise RuntimeError("only part 0 commits")
        self.collect_snapshots(reports)
        if self._abandoned is not None:  # every part dropped it, its lane stopped, before it prepared
            delete_snapshot_objects(self.store, self.prefix, self._abandoned)
            self._abandoned = None
        version = self.version + 1 if self._staged is None else self._staged.version
        errors = [r.error for r in reports if r.error] + [
            f"part {r.part}: prepared version {r.version}, not {version}" for r in reports
            if not r.error and (r.version != version or r.manifest is None)]
        if len(reports) != self.parts:
            errors.append(f"{len(reports)} reports for {self.parts} parts")
        if errors:
            return Outcome(version, False, "; ".join(errors))
        shares = sorted(reports, key=lambda r: r.part)
        try:
            man = merge_parts([r.manifest for r in shares if r.manifest is not None])
            blob = man.to_bytes()
            self.store.put(manifest_key(self.prefix, version), blob)  # commit point
        except Exception as exc:  # noqa: BLE001 - the parts learn it from the outcome
            return Outcome(version, False, f"commit of version {version}: {exc}")
        written = sum(r.bytes_written for r in shares) + len(blob)
        changed, total = sum(r.changed for r in shares), sum(r.total for r in shares)
        info = PublishInfo(version, "keyframe" if man.keyframe else "delta", written,
                           sum(t.nbytes for t in man.tensors), max(r.seconds for r in shares),
                           changed / total if total else 0.0)
        self._account(info)
        info.snapshot_started = self._want_new_snapshot()
        if self.keep_versions:
            collect(self.store, self.prefix, self.keep_versions, busy=self._snap_version)
        return Outcome(version, True, None, info.snapshot_started, info)

    def collect_snapshots(self, reports: list[PartReport]) -> int:
        """Part 0: account the snapshots the parts report ended; once every part's share of the
        snapshot in flight is written, merge them into its manifest (the snapshot's commit point).
        Returns the newest start (committed snapshot or full version)."""
        for r in reports:
            for v, err in r.snapshots:
                self._snap_reports.setdefault(v, {})[r.part] = err
        v = self._snap_version
        got = self._snap_reports.get(v, {}) if v is not None else {}
        if v is None or len(got) < self.parts:
            return self._start
        self._snap_version = None
        self._snap_reports = {k: d for k, d in self._snap_reports.items() if k > v}
        failed = [e for e in got.values() if e]
        try:
            if failed:
                raise WeightSyncError(f"snapshot share failed: {failed[0]}", version=v)
            shares = [Manifest.from_bytes(self.store.get_range(fragment_key(self.prefix, v, part_infix(p)), 0,
                                                               MAX_MANIFEST_OBJECT + 1), v, snapshot=True)
                      for p in range(self.parts)]
            man = merge_parts(shares)
            blob = man.to_bytes()
            self.store.put(snapshot_key(self.prefix, v), blob)
        except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation: the cadence asks again
            log.warning("snapshot of version %d not written: %s", v, exc)
            delete_snapshot_objects(self.store, self.prefix, v)
            self._want_snapshot = True
            return self._start
        self._snapshot_committed(v, sum(man.shard_sizes) + len(blob))
        log.info("snapshot of version %d committed from %d parts", v, self.parts)
        return self._start

    def _want_new_snapshot(self) -> bool:
        """The cadence of :class:`VersionPublisher`, over the merged versions' bytes, with the parts'
        lanes free (no snapshot of theirs in flight)."""
        if self._snap_version is not None or not self._snapshot_due():
            return False
        self._want_snapshot = False
        self._snap_version = self.version
        return True
