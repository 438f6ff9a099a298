"""Object layout and manifest format of a weight-version store.

Under a prefix ``P`` (e.g. ``runs/<run>/weights``)::

    P/v00000007/d-0000.bin ...       delta frames (against version 6), in ~4 MiB shards (the last rides in the manifest)
    P/v00000007/manifest.json.zst    written LAST: the version exists once this object does
    P/v00000007/s-0000.bin ...       snapshot frames (the full weights of version 7), ~32 MiB shards
    P/v00000007/snapshot.json.zst    written last by the snapshot: it exists once this object does
    P/v00000001/k-0000.bin ...       a full version's frames (no base to diff against)
    P/v00000001/keyframe             empty marker: this version is full (a listing tells them apart)
    P/files/<xxh3-128 hex>           side files (config.json...), content-addressed

Every version after the first is a delta against the previous one, committed by its manifest.
A version is *full* (keyframe frames ``k``, no base) only when there is nothing to diff against:
the first version, and after a failed publish, a change of tensor names/shapes/dtypes or a
republish. *Snapshots* (full copies of a committed version, what a late joiner starts from) are
written in the background by the publisher's snapshot lane (:mod:`infra.weightsync.snapshot`):
their own manifest, ``snapshot.json.zst`` (same schema, ``kind: snapshot``, keyframe frames only,
in ``s-`` shards), is written after every snapshot shard, so a reader only ever sees complete
snapshots. A version's *starts* (where a replay may begin) are its full manifest or its committed
snapshot.

A manifest (zstd-compressed JSON) lists the shards with their sizes and, per tensor: name, dtype,
shape, byte size, an xxh3-128 digest, and per chunk of ``chunk_bytes``: the chunk's xxh3-128 digest
and where its frames live (``k``: keyframe frame, ``d``: delta frame, each ``[shard, offset, length,
frame digest]``; a delta version omits ``d`` for chunks that did not change). The frame digest
(xxh3-128 of the frame's bytes) is checked before the frame is decoded, the chunk digest after. The
tensor digest is xxh3-128 over the tensor's name, dtype and shape and its chunk digests, so it is
computed in parallel, is stable for a given ``chunk_bytes``, and binds the layout to the bytes
(a snapshot's tensor digests must equal its version's: the reader checks).

The last, partly filled delta shard of a version is not a separate object: its frames ride in the
manifest object after the JSON (``DLM2`` + u32 length of the zstd JSON + zstd JSON + those frames;
the shard is named ``@manifest`` in ``shards``). That saves the publisher one PUT round trip after
its last chunk and gives the reader those frames with the manifest, to decode while the other
shards download. A manifest that carries no frames is the plain zstd JSON (no ``DLM2`` header).

Parsing checks every name, size, count and offset before a reader uses any of them
(:mod:`infra.weightsync.validate`): a manifest is written by whoever can write the store.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash
import zstandard

from infra.weightsync.errors import ManifestError
from infra.weightsync.validate import MAX_MANIFEST_JSON, MAX_MANIFEST_OBJECT, check_document, default_max_bytes

if TYPE_CHECKING:
    from infra.storage import ObjectStore

FORMAT = "deltaloop-weights/3"
MANIFEST = "manifest.json.zst"
SNAPSHOT = "snapshot.json.zst"  # a snapshot's manifest, written after its shards
SNAPSHOT_TAG = "s"  # snapshot shards: s-0000.bin ...
KEYFRAME_MARK = "keyframe"
TAIL_SHARD = "@manifest"  # shard name of the delta frames carried inside the manifest object
_TAIL_MAGIC = b"DLM2"
_TAIL_LEN = struct.Struct("<I")
_VERSION_RE = re.compile(r"(?:^|/)v(\d{8})/(" + "|".join(map(re.escape, (MANIFEST, KEYFRAME_MARK, SNAPSHOT)))
                         + r"|" + SNAPSHOT_TAG + r"-(?:p\d+-)?(?:\d+\.bin|manifest\.zst))$")


def chunk_bounds(nwords: int, width: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Word ranges ``[start, end)`` of the chunks of a tensor of ``nwords`` words of ``width`` bytes.

    A manifest's chunk entries are these ranges, in order: the publisher cuts tensors with it and a
    reader finds a chunk's words with it, given the manifest's ``chunk_bytes``."""
    step = max(1, chunk_bytes // width)
    return [(s, min(s + step, nwords)) for s in range(0, nwords, step)]


def version_dir(prefix: str, version: int) -> str:
    """``P/v00000007``."""
    return f"{prefix.strip('/')}/v{version:08d}"


def manifest_key(prefix: str, version: int) -> str:
    """``P/v00000007/manifest.json.zst``: the object whose existence commits the version."""
    return f"{version_dir(prefix, version)}/{MANIFEST}"


def snapshot_key(prefix: str, version: int) -> str:
    """``P/v00000007/snapshot.json.zst``: the object whose existence commits the snapshot of a version."""
    return f"{version_dir(prefix, version)}/{SNAPSHOT}"


def part_infix(part: int) -> str:
    """The shard-name infix of part ``part`` of a sharded publish: ``-p003`` (``k-p003-0000.bin``)."""
    return f"-p{part:03d}"


def fragment_key(prefix: str, version: int, infix: str) -> str:
    """``P/v00000007/s-p003-manifest.zst``: one part's share of a snapshot of a sharded publish, written
    after that part's snapshot shards; the snapshot commits when its manifest merges every part's."""
    return f"{version_dir(prefix, version)}/{SNAPSHOT_TAG}{infix}-manifest.zst"


def files_key(prefix: str, digest: str) -> str:
    """``P/files/<digest>``: a side file, stored once by content."""
    return f"{prefix.strip('/')}/files/{digest}"


def digest(data: Any) -> str:
    """xxh3-128 hex digest of a buffer."""
    return xxhash.xxh3_128_hexdigest(data)


def tensor_digest(name: str, dtype: str, shape: list[int], chunk_digests: list[str]) -> str:
    """A tensor's digest: its name, dtype and shape, then its chunk digests (NUL-separated: a
    tensor name has no NUL)."""
    head = f"{name}\0{dtype}\0{','.join(map(str, shape))}\0"
    return xxhash.xxh3_128_hexdigest((head + "".join(chunk_digests)).encode())


def tail_start(head: bytes | bytearray, version: int) -> int | None:
    """Where the carried frames start in a manifest object that begins with ``head`` (which starts
    with ``DLM2``), or None while ``head`` is too short to say; raises :class:`ManifestError` for a
    JSON length no manifest object can have."""
    if len(head) < 4 + _TAIL_LEN.size:
        return None
    end = 4 + _TAIL_LEN.size + _TAIL_LEN.unpack_from(head, 4)[0]
    if end > MAX_MANIFEST_OBJECT:
        raise ManifestError(f"manifest object larger than {MAX_MANIFEST_OBJECT} bytes", version=version)
    return end


def _declared_tail(doc: Any, version: int) -> int:
    """The size the manifest JSON ``doc`` gives its carried frames (0 when it names none; a value
    of the wrong type is left to :func:`~infra.weightsync.validate.check_document` to name)."""
    try:
        n = doc["shard_sizes"][doc["shards"].index(TAIL_SHARD)]
    except (TypeError, KeyError, ValueError, IndexError, AttributeError):
        return 0
    if type(n) is not int:
        return 0
    if not 0 <= n <= MAX_MANIFEST_OBJECT:
        raise ManifestError(f"manifest carries {n} bytes of frames, more than an object may hold", version=version)
    return n


def read_manifest_object(store: "ObjectStore", prefix: str, version: int, snapshot: bool = False) -> bytes:
    """The manifest object of ``version`` (its snapshot's with ``snapshot``), read only up to
    :data:`MAX_MANIFEST_OBJECT` bytes (a larger one is a :class:`ManifestError`, not read whole).
    Raises ``ObjectNotFound`` when absent."""
    key = snapshot_key(prefix, version) if snapshot else manifest_key(prefix, version)
    data = store.get_range(key, 0, MAX_MANIFEST_OBJECT + 1)
    if len(data) > MAX_MANIFEST_OBJECT:
        raise ManifestError(f"manifest object larger than {MAX_MANIFEST_OBJECT} bytes", version=version)
    return data


@dataclass
class Listing:
    """What a listing of a version store says (:func:`scan_versions`)."""

    committed: list[int]  # versions with a manifest, oldest first
    full: set[int]  # committed versions that are full (keyframe marker)
    snapshots: set[int]  # committed versions with a committed snapshot (its manifest exists)
    seen: set[int]  # every version folder seen, committed or not
    partial: set[int]  # folders holding snapshot shards but no snapshot manifest (in progress or abandoned)

    @property
    def starts(self) -> set[int]:
        """Versions a replay can start from: full versions and committed snapshots."""
        return self.full | self.snapshots


def scan_versions(keys: list[str]) -> Listing:
    """What listed keys say: committed versions, full ones, committed snapshots, folders seen."""
    committed: set[int] = set()
    full: set[int] = set()
    snaps: set[int] = set()
    shards: set[int] = set()
    seen: set[int] = set()
    for key in keys:
        m = re.search(r"(?:^|/)v(\d{8})/", key)
        if m:
            seen.add(int(m.group(1)))
        m = _VERSION_RE.search(key)
        if not m:
            continue
        v, name = int(m.group(1)), m.group(2)
        if name == MANIFEST:
            committed.add(v)
        elif name == KEYFRAME_MARK:
            full.add(v)
        elif name == SNAPSHOT:
            snaps.add(v)
        else:
            shards.add(v)
    return Listing(sorted(committed), full & committed, (snaps & committed) - full, seen, shards - snaps)


@dataclass
class ChunkEntry:
    """One chunk of a tensor in one version."""

    h: str
    k: list | None = None  # [shard, offset, length, frame digest] of the keyframe frame
    d: list | None = None  # [shard, offset, length, frame digest] of the delta frame; None = unchanged

    def to_json(self) -> dict[str, Any]:
        """The manifest's JSON for this chunk (absent frames are left out)."""
        out: dict[str, Any] = {"h": self.h}
        if self.k is not None:
            out["k"] = self.k
        if self.d is not None:
            out["d"] = self.d
        return out


@dataclass
class TensorEntry:
    """One tensor in one version: layout, byte size, digest (:func:`tensor_digest`), chunks."""

    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    h: str
    chunks: list[ChunkEntry]


@dataclass
class Manifest:
    """Everything a reader needs to know about one version (see the module docstring)."""

    version: int
    keyframe: bool
    base: int | None  # version the delta frames are against (None: keyframe only)
    chunk_bytes: int
    shards: list[str]  # object names relative to the version dir
    tensors: list[TensorEntry]
    files: dict[str, str] = field(default_factory=dict)  # side file name -> digest
    meta: dict[str, Any] = field(default_factory=dict)
    tail: Any = b""  # frames of the ``TAIL_SHARD`` shard, after the JSON in the same object (bytes; a
    # reader's :class:`~infra.weightsync.tailstream.StreamedTail` while they still arrive)
    shard_sizes: list[int] = field(default_factory=list)  # bytes of each shard, in ``shards`` order
    snapshot: bool = False  # a snapshot's manifest (``snapshot.json.zst``), not a version's

    def to_bytes(self) -> bytes:
        """The manifest object: zstd JSON, preceded by ``DLM2`` + length and followed by the
        carried frames when there are any."""
        doc = {
            "format": FORMAT,
            "kind": "snapshot" if self.snapshot else "version",
            "version": self.version,
            "keyframe": self.keyframe,
            "base": self.base,
            "chunk_bytes": self.chunk_bytes,
            "shards": self.shards,
            "shard_sizes": self.shard_sizes,
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": t.shape,
                    "nbytes": t.nbytes,
                    "h": t.h,
                    "chunks": [c.to_json() for c in t.chunks],
                }
                for t in self.tensors
            ],
            "files": self.files,
            "meta": self.meta,
        }
        packed = zstandard.ZstdCompressor(level=3).compress(json.dumps(doc, separators=(",", ":")).encode())
        if not self.tail:
            return packed
        return b"".join((_TAIL_MAGIC, _TAIL_LEN.pack(len(packed)), packed, self.tail))

    @classmethod
    def from_bytes(cls, data: bytes, version: int, max_bytes: int | None = None,
                   snapshot: bool = False) -> "Manifest":
        """Parse and check a manifest object of ``version`` (:func:`~infra.weightsync.validate.check_document`;
        ``max_bytes``: the most tensor bytes it may declare, default this machine's memory;
        ``snapshot``: a snapshot's manifest is expected, else a version's); raises
        :class:`ManifestError` naming the field when it is unreadable or fails a check."""
        if len(data) > MAX_MANIFEST_OBJECT:
            raise ManifestError(f"manifest object larger than {MAX_MANIFEST_OBJECT} bytes", version=version)
        tail = b""
        if data[:4] == _TAIL_MAGIC:
            end = tail_start(data, version)
            if end is None or end > len(data):
                raise ManifestError("manifest object truncated", version=version)
            data, tail = data[4 + _TAIL_LEN.size : end], data[end:]
        return cls.from_packed(data, tail, len(tail), version, max_bytes, snapshot)

    @classmethod
    def from_packed(cls, data: bytes, tail: Any, tail_bytes: int | None, version: int,
                    max_bytes: int | None = None, snapshot: bool = False) -> "Manifest":
        """:meth:`from_bytes` of an object split in its zstd JSON ``data`` and its carried frames
        ``tail`` (``tail_bytes`` of them; None: as many as the JSON declares, for frames still on
        their way: :mod:`infra.weightsync.tailstream`)."""
        try:
            if zstandard.frame_content_size(data) > MAX_MANIFEST_JSON:  # (zstd would allocate it all)
                raise ValueError(f"its JSON is over {MAX_MANIFEST_JSON} bytes")
            text = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_MANIFEST_JSON)
            doc = json.loads(text)
        except (zstandard.ZstdError, ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise ManifestError(f"unreadable manifest: {str(exc)[:200]}", version=version) from None
        if type(doc) is dict and doc.get("format") != FORMAT:
            raise ManifestError(f"unknown manifest format {str(doc.get('format'))[:60]!r} (this reader reads "
                                f"{FORMAT!r})", version=version)
        if tail_bytes is None:
            tail_bytes = _declared_tail(doc, version)
        check_document(doc, version, tail_bytes, default_max_bytes() if max_bytes is None else max_bytes, snapshot)
        tensors = []
        for ti, t in enumerate(doc["tensors"]):
            entry = TensorEntry(t["name"], t["dtype"], t["shape"], t["nbytes"], t["h"],
                                [ChunkEntry(c["h"], c.get("k"), c.get("d")) for c in t["chunks"]])
            if tensor_digest(entry.name, entry.dtype, entry.shape, [c.h for c in entry.chunks]) != entry.h:
                raise ManifestError(f"manifest tensors[{ti}].h: not the digest of the tensor's name, dtype, "
                                    "shape and chunk digests", version=version)
            tensors.append(entry)
        return cls(version, doc["keyframe"], doc.get("base"), doc["chunk_bytes"], doc["shards"], tensors,
                   doc.get("files", {}), doc.get("meta", {}), tail, doc["shard_sizes"], snapshot)

    def signature(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """Names, dtypes and shapes, in order (what a delta needs to match)."""
        return [(t.name, t.dtype, tuple(t.shape)) for t in self.tensors]
