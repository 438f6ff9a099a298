"""``deltaloop sync``: move safetensors checkpoints through an object store as keyframes + deltas.

    deltaloop sync publish DIR --store URI [--endpoint-url URL]      # prints version + bytes written
    deltaloop sync fetch --store URI [--version N] --out DIR         # byte-identical safetensors folder
    deltaloop sync fetch --store URI --out DIR --allow-older         # newest version that verifies
    deltaloop sync fetch --store URI --out DIR --tensor GLOB ...     # only these tensors (one stage's)
    deltaloop sync list --store URI                                   # committed versions
    deltaloop sync gc --store URI --keep N                            # collect old versions

Useful on its own for moving checkpoints between clusters: a fetch into a folder that a previous
fetch wrote downloads only the deltas since; a download of 64 MB or more prints its progress on
stderr once a second.

A fetch never hands back other weights than the ones asked for without saying so: without
``--version`` it fetches the newest committed version, and if that does not verify it exits 1
naming the version and object that failed (nothing is written). ``--allow-older`` accepts the
newest version that does verify instead, and the line on stdout says which version was written and
why the newer one was not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

if TYPE_CHECKING:
    from infra.storage import ObjectStore
    from infra.weightsync import VersionReader

sync_app = typer.Typer(help="Publish/fetch safetensors checkpoints as versioned keyframes + deltas.",
                       no_args_is_help=True)

_STORE = typer.Option(..., "--store", help="Object store URI: file:///path, a path, or s3://bucket/prefix.")
_PREFIX = typer.Option("weights", "--prefix", help="Key prefix of the version store inside the store.")
_ENDPOINT = typer.Option(None, "--endpoint-url", help="S3 endpoint URL (MinIO, moto, R2...).")
_THREADS = typer.Option(2, "--threads", min=1, max=256, help="Encode/decode threads.")


def _open(store: str, endpoint_url: Optional[str]) -> "ObjectStore":
    from infra.storage import open_store

    return open_store(store, endpoint_url=endpoint_url)


@sync_app.command("publish")
def publish(
    folder: Path = typer.Argument(..., exists=True, file_okay=False, help="A safetensors model folder."),
    store: str = _STORE,
    prefix: str = _PREFIX,
    endpoint_url: Optional[str] = _ENDPOINT,
    chain_fraction: float = typer.Option(1.0, "--snapshot-chain-fraction", min=0.0, max=100.0,
                                         help="Snapshot once the deltas since the last exceed this fraction of one."),
    codec: str = typer.Option("auto", "--codec", help="Delta codec: auto, sparse or xor."),
    zstd_level: int = typer.Option(1, "--zstd-level", min=-7, max=22, help="zstd level of frames."),
    snapshot: bool = typer.Option(False, "--snapshot", help="Also write a snapshot of this version."),
    threads: int = _THREADS,
) -> None:
    """Publish FOLDER as the next version; prints the version and the bytes written."""
    from infra.weightsync import VersionPublisher, read_folder

    tensors, files, meta = read_folder(folder)
    pub = VersionPublisher(_open(store, endpoint_url), prefix, snapshot_chain_fraction=chain_fraction,
                           codec=codec, zstd_level=zstd_level, threads=threads)  # type: ignore[arg-type]
    info = pub.publish(tensors, files=files, meta=meta, snapshot=snapshot)
    pub.close(wait_snapshot=True)  # a one-shot process: finish the snapshot it started
    typer.echo(
        f"version {info.version} ({info.kind}): {info.bytes_written} bytes written "
        f"({info.bytes_written / max(info.raw_bytes, 1):.3%} of {info.raw_bytes} raw), "
        f"{info.changed_fraction:.3%} changed, {info.seconds:.2f}s"
    )


@sync_app.command("fetch")
def fetch(
    store: str = _STORE,
    out: Path = typer.Option(..., "--out", help="Folder to write (created; updated incrementally if a "
                             "previous fetch wrote it)."),
    version: Optional[int] = typer.Option(None, "--version", min=1, help="Version to fetch (default: newest)."),
    prefix: str = _PREFIX,
    endpoint_url: Optional[str] = _ENDPOINT,
    threads: int = _THREADS,
    strict: bool = typer.Option(False, "--strict", help="Fail on the first fault instead of recovering."),
    allow_older: bool = typer.Option(False, "--allow-older", help="Without --version: if the newest version "
                                     "does not verify, fetch the newest one that does (stdout says which)."),
    tensor: Optional[List[str]] = typer.Option(None, "--tensor", help="Fetch only the tensors this name or "
                                               "glob matches (repeatable; e.g. 'model.layers.1[0-9].*', the "
                                               "layers one pipeline stage serves): only their frames are "
                                               "downloaded, and OUT holds just these tensors."),
) -> None:
    """Fetch a version into OUT as a safetensors folder identical to the one published (with --tensor,
    the same files holding only the tensors named)."""
    import logging

    from infra.weightsync import VersionReader, WeightSyncError, read_folder, read_marker, write_folder

    if allow_older and version is not None:
        raise typer.BadParameter("--allow-older applies only without --version", param_hint="--allow-older")

    # each fault the reader recovers from is printed below once; a fault it cannot recover from is
    # the one ``error:`` line: its log records would only repeat them
    logging.getLogger("infra.weightsync.reader").setLevel(logging.ERROR)
    st = _open(store, endpoint_url)
    rd = VersionReader(st, prefix, threads=threads, strict=strict)
    names = _matching(rd, tensor or [], version)
    rd.names = frozenset(names) if names is not None else None
    have = have_version = None
    mark = read_marker(out)
    if mark and mark.get("store") == st.uri and mark.get("prefix") == prefix and mark.get("tensors") == names:
        try:
            have, _files, _meta = read_folder(out)
            have_version = int(mark["version"])
        except (OSError, ValueError, KeyError):
            have = have_version = None
    try:
        tensors, v = rd.fetch(version, have=have, have_version=have_version, allow_older=allow_older,
                              progress=Progress())
    except WeightSyncError as exc:
        if version is not None or allow_older:
            raise
        raise type(exc)(f"the newest committed version {rd.latest()} does not verify: {exc} (--allow-older "
                        "fetches the newest version that does)") from None
    man = rd.manifest(v)
    write_folder(out, tensors, rd.files(v), man.meta, marker={"store": st.uri, "prefix": prefix, "version": v,
                                                              "tensors": names}, only=names)
    for err in rd.last_errors:
        typer.echo(f"recovered from: {err}", err=True)
    read = rd.last_stats.get("bytes_read", 0)
    typer.echo(f"version {v} -> {out} ({read} bytes read, via {rd.last_stats.get('path')})")
    newest = int(rd.last_stats.get("newest") or v)  # type: ignore[call-overload]
    if v != newest:
        why = next((str(e) for e in rd.last_errors if e.version is not None and e.version > v), "")
        typer.echo(f"older than asked: the newest committed version {newest} does not verify ({why}); "
                   f"version {v} is the newest that does")


class Progress:
    """A fetch's progress on stderr (``fetched X of Y MB (P%)``): at most once per ``every_s`` and when
    the download ends, for downloads of ``min_bytes`` or more (smaller ones stay quiet)."""

    def __init__(self, every_s: float = 1.0, min_bytes: int = 64 << 20, clock: Callable[[], float] = time.monotonic,
                 echo: Callable[[str], object] = lambda line: typer.echo(line, err=True)) -> None:
        self.every_s, self.min_bytes, self.clock, self.echo = every_s, min_bytes, clock, echo
        self.last = float("-inf")

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if total < self.min_bytes or (done < total and now - self.last < self.every_s):
            return
        self.last = now
        self.echo(f"fetched {done / 1e6:.1f} of {total / 1e6:.1f} MB ({100 * done / total:.0f}%)")


def _matching(rd: "VersionReader", patterns: list[str], version: int | None) -> list[str] | None:
    """The names of the tensors of ``version`` (default: the newest) that ``patterns`` match (names or
    ``fnmatch`` globs; each must match one, else :class:`IncompatibleTensors`), read with ``rd``; None
    without patterns. When that manifest cannot be read, the patterns are taken as names and the fetch
    reports the fault."""
    from fnmatch import fnmatchcase

    from infra.weightsync import IncompatibleTensors, WeightSyncError

    if not patterns:
        return None
    target = version if version is not None else rd.latest()
    try:
        names = [t.name for t in rd.manifest(target).tensors] if target is not None else None
    except WeightSyncError:
        names = None
    if names is None:
        return sorted(set(patterns))
    picked: set[str] = set()
    for pattern in patterns:
        hits = [n for n in names if fnmatchcase(n, pattern)]
        if not hits:
            raise IncompatibleTensors(f"no tensor matches {pattern!r}", version=target)
        picked.update(hits)
    return sorted(picked)


@sync_app.command("list")
def list_versions(store: str = _STORE, prefix: str = _PREFIX, endpoint_url: Optional[str] = _ENDPOINT) -> None:
    """List committed versions (K = full version, S = delta with a committed snapshot, d = delta)."""
    from infra.weightsync import scan_versions

    listing = scan_versions(_open(store, endpoint_url).list(prefix.strip("/") + "/"))
    for v in listing.committed:
        typer.echo(f"{v}\t{'K' if v in listing.full else 'S' if v in listing.snapshots else 'd'}")


@sync_app.command("gc")
def gc(
    store: str = _STORE,
    keep: int = typer.Option(..., "--keep", min=1, help="Keep the newest N versions (and their start)."),
    prefix: str = _PREFIX,
    endpoint_url: Optional[str] = _ENDPOINT,
) -> None:
    """Delete versions no reader of the newest KEEP versions needs."""
    from infra.weightsync import collect

    deleted = collect(_open(store, endpoint_url), prefix, keep)
    typer.echo(f"deleted versions: {', '.join(map(str, deleted)) or 'none'}")


def register(app: typer.Typer) -> None:
    """Attach the ``sync`` sub-commands."""
    app.add_typer(sync_app, name="sync")
