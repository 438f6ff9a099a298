"""Every size, count, offset and name a reader takes from a version manifest is checked when the
manifest is parsed, before anything is allocated or downloaded, and refused with the weight-sync
error family naming the field (replays finding 3 of issue #15: a crafted ``nbytes`` made the reader
spin and raise ``MemoryError``, which skipped its fallback and strict handling; and finding 2 for
names: shard names and side-file digests become object keys)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from infra.storage import FileStore
from infra.weightsync import CorruptData, ManifestError, VersionPublisher, VersionReader, WeightSyncError
from infra.weightsync.chunks import apply_frame
from infra.weightsync.layout import Manifest, manifest_key, snapshot_key
from tests.weightsync_helpers import Drift, manifest_blob, manifest_doc, same

PREFIX = "runs/v/weights"
Edit = Callable[[dict[str, Any]], Any]


@pytest.fixture()
def store(tmp_path: Path) -> FileStore:
    """Versions 1 (full), 2 (delta, frames in shards and in the manifest), 3 (delta, and a snapshot)."""
    st = FileStore(tmp_path / "store")
    d = Drift()
    pub = VersionPublisher(st, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, delta_shard_bytes=2 << 10)
    for v in (1, 2, 3):
        pub.publish(d.bf16(), files={"config.json": b"{}"},
                    meta={"safetensors": {"model.safetensors": {"tensors": list(d.bf16()), "metadata": None}}},
                    snapshot=v == 3)
        d.step()
    pub.wait_snapshot()
    pub.close()
    return st


def _set(path: str, value: Any) -> Edit:
    """An edit setting ``doc[path]`` (dotted, integer parts index lists)."""
    def edit(doc: dict[str, Any]) -> None:
        parts = [int(p) if p.lstrip("-").isdigit() else p for p in path.split(".")]
        node: Any = doc
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value(node[parts[-1]]) if callable(value) else value
    return edit


def _huge(doc: dict[str, Any]) -> None:
    """An 8 TiB tensor, self-consistent (shape x itemsize = nbytes, one chunk entry per 256 MiB), so
    only a bound on the total can refuse it."""
    doc["chunk_bytes"] = 256 << 20
    for t in doc["tensors"]:
        t["chunks"] = t["chunks"][:1]
    t0 = doc["tensors"][0]
    t0["shape"], t0["nbytes"] = [1 << 42], 1 << 43
    t0["chunks"] = t0["chunks"] * (1 << 15)


def _dup_names(doc: dict[str, Any]) -> None:
    doc["tensors"][1]["name"] = doc["tensors"][0]["name"]


def _layout(tensors: Any, metadata: Any = None, name: str = "model.safetensors") -> Edit:
    return _set("meta.safetensors", {name: {"tensors": tensors, "metadata": metadata}})


CASES: list[tuple[str, int, Edit]] = [  # (text the error must contain, version, edit)
    ("nbytes", 1, _set("tensors.0.nbytes", lambda v: v * 2)),
    ("nbytes", 1, _huge),
    ("shape", 1, _set("tensors.0.shape", [-512, -64])),
    ("shape", 1, _set("tensors.0.shape", "512x64")),
    ("shape", 1, _set("tensors.0.shape", [1] * 100 + [512, 64])),
    ("shape", 1, _set("tensors.0.shape", [512, 64.0])),
    ("dtype", 1, _set("tensors.0.dtype", "float128")),
    ("dtype", 1, _set("tensors.0.dtype", "__class__")),
    ("chunks", 1, _set("tensors.0.chunks", lambda c: c + c[:1])),
    ("chunks", 1, _set("tensors.0.chunks", lambda c: c[:-1])),
    ("chunks", 1, _set("tensors.0.chunks", {})),
    ("chunk_bytes", 1, _set("chunk_bytes", 0)),
    ("chunk_bytes", 1, _set("chunk_bytes", -4096)),
    ("chunk_bytes", 1, _set("chunk_bytes", True)),
    (".k", 1, _set("tensors.0.chunks.1.k.0", 99)),
    (".k", 1, _set("tensors.0.chunks.1.k.1", -1)),
    (".k", 1, _set("tensors.0.chunks.1.k.2", 1 << 40)),
    (".k", 1, _set("tensors.0.chunks.1.k.2", 0)),
    (".k", 1, _set("tensors.0.chunks.1.k", lambda k: k[:3])),
    (".k", 1, _set("tensors.0.chunks.1.k", "k-0000.bin")),
    (".d", 2, _set("tensors.0.chunks.0.d.1", 1 << 30)),  # past the end of its shard or of the carried frames
    ("shards", 1, _set("shards.0", "../../../elsewhere/k-0000.bin")),
    ("shards", 1, _set("shards.0", "/etc/passwd")),
    ("shards", 1, _set("shards.0", 5)),
    ("files", 1, _set("files", {"config.json": "../../../../elsewhere/secret"})),
    ("files", 1, _set("files", {"../config.json": "0" * 32})),
    ("files", 1, _set("files", ["config.json"])),
    ("meta.safetensors", 1, _layout(["no.such.tensor"])),
    ("meta.safetensors", 1, _layout(["embed.weight"], {"format": 1})),
    ("meta.safetensors", 1, _layout(["embed.weight"], name="../model.safetensors")),
    ("meta.safetensors", 1, _set("meta.safetensors", ["model.safetensors"])),
    ("name", 1, _set("tensors.1.name", 7)),
    ("name", 1, _set("tensors.1.name", "")),
    ("name", 1, _dup_names),
    ("tensors[0].h", 1, _set("tensors.0.h", lambda h: h[::-1])),
    ("tensors", 1, _set("tensors", {"embed.weight": {}})),
    ("version", 1, _set("version", "1")),
    ("base", 2, _set("base", "1")),
    ("base", 2, _set("base", 2)),
    ("keyframe", 1, _set("keyframe", "yes")),
    ("base", 1, _set("base", 0)),  # a full version has no base
    ("base", 2, _set("base", None)),  # a delta needs one
    ("base", 2, _set("keyframe", True)),
    ("kind", 2, _set("kind", "snapshot")),  # a snapshot's manifest cannot stand in for a version's
    ("kind", 2, _set("kind", None)),
]


def _crafted(store: FileStore, version: int, edit: Edit) -> bytes:
    doc, tail = manifest_doc(store.get(manifest_key(PREFIX, version)))
    doc = copy.deepcopy(doc)
    edit(doc)
    return manifest_blob(doc, tail)


@pytest.mark.parametrize("field,version,edit", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_crafted_manifest_refused_at_parse_naming_the_field(store: FileStore, field: str, version: int,
                                                            edit: Edit) -> None:
    """Replays finding 3 (and 2, for names) of issue #15: each crafted field is refused by the parser
    itself, before any reader allocates or downloads anything, with a ManifestError naming it."""
    blob = _crafted(store, version, edit)
    with pytest.raises(ManifestError) as err:
        Manifest.from_bytes(blob, version)
    assert field in str(err.value) and f"version {version}" in str(err.value), str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


@pytest.mark.parametrize("case", [1, 6, 14, 15, 16, 20, 21])
def test_crafted_version_is_a_weight_sync_error_for_the_reader(store: FileStore, case: int) -> None:
    """Replays finding 3 of issue #15 through the reader: absurd sizes, a shard index or offset out
    of range, traversing object keys raise ManifestError (strict) -- not MemoryError, IndexError or
    a storage ValueError -- and a non-strict reader falls back as designed (here: an explicit
    target is never replaced, so the error is raised after the fallbacks failed)."""
    field, version, edit = CASES[case]
    store.put(manifest_key(PREFIX, version), _crafted(store, version, edit))
    with pytest.raises(ManifestError, match=field.replace(".", r"\.")):
        VersionReader(store, PREFIX, strict=True).fetch(version)
    rd = VersionReader(store, PREFIX)
    with pytest.raises(WeightSyncError):
        rd.fetch(version)
    assert rd.last_errors and all(isinstance(e, WeightSyncError) for e in rd.last_errors)


def test_crafted_newest_version_fails_or_falls_back_to_the_newest_good_one(store: FileStore) -> None:
    """Replays finding 3 of issue #15: a crafted newest version is a ManifestError, so a non-strict
    reader with no explicit target fails naming it, or, allowed an older version, returns the newest
    one that verifies."""
    want, _ = VersionReader(store, PREFIX).fetch(3)
    d = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, delta_shard_bytes=2 << 10)
    for _ in range(4):
        d.step()
    pub.publish(d.bf16())  # version 4: a delta
    store.put(manifest_key(PREFIX, 4), _crafted(store, 4, _set("tensors.0.nbytes", 1 << 60)))
    rd = VersionReader(store, PREFIX)
    with pytest.raises(ManifestError, match="nbytes"):
        rd.fetch()
    got, v = rd.fetch(allow_older=True)
    assert v == 3 and same(got, want)
    assert isinstance(rd.last_errors[0], ManifestError) and "nbytes" in str(rd.last_errors[0])


def test_oversized_manifest_object_refused_before_reading_it_whole(store: FileStore) -> None:
    """Replays finding 3 of issue #15 for the manifest object itself: a manifest object of hundreds
    of MiB (JSON or carried frames) is refused, not read into memory and decompressed."""
    from infra.weightsync.validate import MAX_MANIFEST_OBJECT

    doc, _tail = manifest_doc(store.get(manifest_key(PREFIX, 2)))
    store.put(manifest_key(PREFIX, 2), manifest_blob(doc, b"\0" * (MAX_MANIFEST_OBJECT + 1)))
    with pytest.raises(ManifestError, match="manifest object"):
        VersionReader(store, PREFIX, strict=True).manifest(2)


def test_a_configured_total_bound_refuses_bigger_versions(store: FileStore) -> None:
    """``max_bytes`` bounds the bytes a version may declare (the default is this machine's memory)."""
    total = sum(t.nbytes for t in VersionReader(store, PREFIX).manifest(1).tensors)
    with pytest.raises(ManifestError, match="max_bytes"):
        VersionReader(store, PREFIX, strict=True, max_bytes=total - 1).fetch(1)
    got, v = VersionReader(store, PREFIX, strict=True, max_bytes=total).fetch(1)
    assert v == 1 and len(got) == 6


def test_a_replaced_frame_is_refused_before_it_is_decoded(store: FileStore) -> None:
    """Replays finding 3 of issue #15 for frames: every frame's digest is in the manifest and is
    checked before the decoder sees the frame, so a replaced frame never touches the buffer."""
    man = VersionReader(store, PREFIX).manifest(1)
    t = man.tensors[0]
    loc = t.chunks[0].k
    assert loc is not None and len(loc) == 4  # [shard, offset, length, frame digest]
    frame = bytearray(store.get_range(f"{PREFIX}/v00000001/{man.shards[loc[0]]}", loc[1], loc[2]))
    buf = np.full(16 << 10 >> 1, 0xABCD, np.uint16)
    before = buf.copy()
    frame[-1] ^= 0x01
    with pytest.raises(CorruptData, match="frame digest"):
        apply_frame(bytes(frame), buf, t.chunks[0].h, frame_h=loc[3])
    assert np.array_equal(buf, before)
    frame[-1] ^= 0x01
    apply_frame(bytes(frame), buf, t.chunks[0].h, frame_h=loc[3])
    want, _ = VersionReader(store, PREFIX).fetch(1)
    assert np.array_equal(buf, want["embed.weight"].view(torch.uint16).reshape(-1).numpy()[: len(buf)])


def test_shape_and_name_are_part_of_the_tensor_digest(store: FileStore) -> None:
    """Two tensors of one shape swapped by name, or a shape changed to another of the same size,
    do not match the tensor digests: the manifest is refused rather than read as other weights."""
    def swap(doc: dict[str, Any]) -> None:
        a, b = doc["tensors"][0], doc["tensors"][1]
        a["name"], b["name"] = b["name"], a["name"]

    for edit in (swap, _set("tensors.0.shape", [64, 512])):
        with pytest.raises(ManifestError, match=r"tensors\[\d\]\.h"):
            Manifest.from_bytes(_crafted(store, 1, edit), 1)


def test_publisher_manifests_parse_and_round_trip(store: FileStore) -> None:
    """What the real publisher writes passes every check, and parsing is the inverse of writing."""
    for v in (1, 2, 3):
        blob = store.get(manifest_key(PREFIX, v))
        man = Manifest.from_bytes(blob, v)
        assert Manifest.from_bytes(man.to_bytes(), v) == man
    snap = Manifest.from_bytes(store.get(snapshot_key(PREFIX, 3)), 3, snapshot=True)
    assert snap.snapshot and snap.keyframe and snap.base is None and not snap.tail
    assert Manifest.from_bytes(snap.to_bytes(), 3, snapshot=True) == snap
    with pytest.raises(ManifestError, match="kind"):  # not where a version's manifest is expected
        Manifest.from_bytes(snap.to_bytes(), 3)


def _zstd_declaring(size: int) -> bytes:
    """A zstd frame whose header declares ``size`` bytes of content (and holds none)."""
    import struct

    return struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", size) + b"\x01\x00\x00"


def test_zstd_declared_sizes_are_checked_before_decompressing() -> None:
    """Replays finding 3 of issue #15 through zstd: a frame header declaring 1 TiB made zstd allocate
    it (MemoryError) whatever ``max_output_size`` said, in a manifest object and in a frame."""
    import struct

    from infra.weightsync.codec import TAG_RAW

    with pytest.raises(ManifestError, match="unreadable manifest"):
        Manifest.from_bytes(_zstd_declaring(1 << 40), 1)
    buf = np.zeros(64, np.uint16)
    frame = struct.pack("<BBQ", TAG_RAW, 2, 64) + _zstd_declaring(1 << 40)
    with pytest.raises(CorruptData, match="declares"):
        apply_frame(frame, buf, "0" * 32)


def test_dtype_sizes_agree_with_torch() -> None:
    """The table the parser checks sizes with (no torch import) says what torch says."""
    from infra.weightsync.rawbytes import DTYPE_SIZES

    known = {n: getattr(torch, n) for n in DTYPE_SIZES if isinstance(getattr(torch, n, None), torch.dtype)}
    assert {"float32", "bfloat16", "float16", "int64", "bool", "uint8"} <= set(known)
    assert all(dt.itemsize == DTYPE_SIZES[n] for n, dt in known.items())


def test_gc_survives_a_crafted_kept_manifest(store: FileStore) -> None:
    """Replays finding 3 of issue #15 against collection: a crafted manifest among the kept versions
    (which a publisher with ``keep_versions`` reads after every publish) neither raises out of
    ``collect`` nor lets it delete side files it cannot tell are unused; old versions still go."""
    from infra.weightsync import collect

    store.put(manifest_key(PREFIX, 3), _crafted(store, 3, _set("tensors", {"embed.weight": {}})))
    files_before = store.list(f"{PREFIX}/files/")
    assert collect(store, PREFIX, keep=1) == [1, 2]
    assert store.list(f"{PREFIX}/files/") == files_before and not store.exists(manifest_key(PREFIX, 1))
