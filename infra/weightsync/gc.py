"""Garbage collection of old versions that no reader path still needs.

``collect(store, prefix, keep)`` keeps the newest ``keep`` committed versions *and what a replay of
them starts from*: the anchor is the newest start (a full version or a committed snapshot, see
:mod:`infra.weightsync.layout`) at or below the oldest kept version, and nothing at or above the
anchor is deleted (every delta after it, and every newer snapshot). A snapshot still being written
does not count until its manifest exists. Everything older than the anchor goes, manifest first (so
a version disappears atomically from readers' point of view, exactly like it appeared), then its
data objects (its snapshot's included). Orphan folders of versions that never committed (a
publisher killed mid-upload) below the newest version are removed too, and so are the shards of
snapshots that never committed (abandoned, failed, or left by a killed publisher), except the one
in flight (``busy``: the publisher passes it). Side files no kept manifest references are deleted
last; if a kept manifest cannot be read (corrupt, or crafted by a writer of the store) no side file
is deleted, since which ones it needs is unknown, and the rest of the collection still happens.

A reader that is replaying an old, now-collected version gets :class:`MissingObject` /
:class:`VersionNotFound` and falls back to the anchor, which is always kept. Run it from the single
writer (the publisher does when ``keep_versions`` is set).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from infra.weightsync.errors import WeightSyncError
from infra.weightsync.layout import (
    MANIFEST,
    SNAPSHOT_TAG,
    Listing,
    Manifest,
    manifest_key,
    read_manifest_object,
    scan_versions,
    version_dir,
)

if TYPE_CHECKING:
    from infra.storage import ObjectStore

log = logging.getLogger(__name__)


def collect(store: "ObjectStore", prefix: str, keep: int, busy: int | None = None) -> list[int]:
    """Delete versions older than the start anchoring the newest ``keep``, and the shards of
    snapshots that never committed (but those of version ``busy``, being written); returns the
    versions deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    prefix = prefix.strip("/")
    keys = store.list(prefix + "/")
    listing = scan_versions(keys)
    committed = listing.committed
    if not committed:
        return []
    by_version: dict[int, list[str]] = {}
    for key in keys:
        m = re.search(r"(?:^|/)v(\d{8})/", key)
        if m:
            by_version.setdefault(int(m.group(1)), []).append(key)
    for v in sorted(listing.partial - {busy}):
        delete_snapshot_objects(store, prefix, v, by_version.get(v, []))
    oldest_kept = committed[max(0, len(committed) - keep)]
    anchors = [k for k in listing.starts if k <= oldest_kept]
    if not anchors:
        return []
    anchor = max(anchors)
    newest = committed[-1]
    doomed = sorted(v for v in listing.seen if (v < anchor or (v < newest and v not in committed)) and v != busy)
    for v in doomed:
        if v in committed:
            store.delete(manifest_key(prefix, v))
        for key in by_version.get(v, []):
            if not key.endswith("/" + MANIFEST):
                store.delete(key)
    file_keys = [k for k in keys if k.startswith(prefix + "/files/")]
    live = _live_files(store, prefix, [v for v in committed if v >= anchor]) if file_keys else None
    if live is not None:
        for k in file_keys:
            if k.rsplit("/", 1)[1] not in live:
                store.delete(k)
    return [v for v in doomed if v in committed]


def _live_files(store: "ObjectStore", prefix: str, versions: list[int]) -> set[str] | None:
    """Digests of the side files ``versions`` reference; None if one of their manifests is unreadable."""
    live: set[str] = set()
    for v in versions:
        try:
            live.update(Manifest.from_bytes(read_manifest_object(store, prefix, v), v).files.values())
        except WeightSyncError as exc:
            log.warning("side files kept: %s", exc)
            return None
    return live


def clean_orphans(store: "ObjectStore", prefix: str, listing: Listing) -> None:
    """Delete what killed publishers left (a new publisher runs it before its first version):
    version folders above the newest committed version, and the objects of snapshots that never
    committed."""
    newest = listing.committed[-1] if listing.committed else 0
    for orphan in sorted(v for v in listing.seen if v > newest):
        for key in store.list(version_dir(prefix, orphan) + "/"):
            store.delete(key)
    for v in sorted(listing.partial & set(listing.committed)):
        delete_snapshot_objects(store, prefix, v)


def delete_snapshot_objects(store: "ObjectStore", prefix: str, version: int, keys: list[str] | None = None) -> None:
    """Delete the snapshot objects (``s-`` shards, and the parts' shares of a sharded publish) of
    ``version``, whose snapshot never committed; ``keys``: the version's objects, if already listed."""
    for key in keys if keys is not None else store.list(version_dir(prefix, version) + "/"):
        if key.rsplit("/", 1)[-1].startswith(SNAPSHOT_TAG + "-"):
            store.delete(key)


def version_objects(store: "ObjectStore", prefix: str, version: int) -> list[str]:
    """Every object of one version (for tools and tests)."""
    return store.list(version_dir(prefix.strip("/"), version) + "/")
