"""Faults: truncated / corrupted / missing objects, wrong base, publisher killed mid-upload.

In every case the reader never returns a partial version, the error names version, tensor and object,
a non-strict reader recovers the version asked for by another path where one exists, and returns an
older version only when the caller allows it (``allow_older``): then the newest one that verifies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infra.storage import FileStore
from infra.weightsync import (
    CorruptData,
    ManifestError,
    MissingObject,
    VersionPublisher,
    VersionReader,
    WrongBase,
)
from tests.weightsync_helpers import Drift, same

PREFIX = "runs/f/weights"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


def _history(store: FileStore, n: int = 4, k: int = 2) -> list[dict[str, torch.Tensor]]:
    """Versions 1..n (1 full, then deltas) with a snapshot of 1+k, 1+2k... (k=2: starts 1, 3)."""
    d = Drift()
    # small delta shards, so each delta has shard objects besides the frames its manifest carries
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10,
                           delta_shard_bytes=2 << 10)
    out = []
    for v in range(1, n + 1):
        out.append(d.bf16())
        if pub.publish(out[-1], snapshot=v > 1 and (v - 1) % k == 0).snapshot_started:
            pub.wait_snapshot()
        d.step()
    pub.close()
    return out


def _path(store: FileStore, version: int, shard: str) -> Path:
    return store.root / PREFIX / f"v{version:08d}" / shard


def test_truncated_delta_names_version_and_tensor(store: FileStore) -> None:
    h = _history(store)
    p = _path(store, 4, "d-0000.bin")
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    have, _ = VersionReader(store, PREFIX).fetch(3)
    with pytest.raises(CorruptData) as err:
        VersionReader(store, PREFIX, strict=True).fetch(have=have, have_version=3)
    assert "version 4" in str(err.value) and "tensor '" in str(err.value)
    assert err.value.version == 4 and err.value.tensor
    # non-strict: no path reaches 4, and the newest version is never silently replaced by an older one
    rd = VersionReader(store, PREFIX)
    with pytest.raises(CorruptData) as err:
        rd.fetch(have=have, have_version=3)
    assert err.value.version == 4 and err.value.key == f"{PREFIX}/v00000004/d-0000.bin"
    # unless the caller accepts an older version: then the newest that verifies (3, the caller's own)
    got, v = rd.fetch(have=have, have_version=3, allow_older=True)
    assert v == 3 and same(got, h[2]) and rd.last_errors and rd.last_stats["newest"] == 4
    with pytest.raises(CorruptData):  # an explicit target is never silently replaced
        rd.fetch(4)


def test_corrupted_byte_detected(store: FileStore) -> None:
    _history(store)
    p = _path(store, 2, "d-0000.bin")
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))
    with pytest.raises(CorruptData) as err:
        VersionReader(store, PREFIX, strict=True).fetch(2)
    assert err.value.version == 2 and err.value.tensor


def test_corrupt_snapshot_recovers_from_older_start(store: FileStore) -> None:
    h = _history(store)
    p = _path(store, 3, "s-0000.bin")
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    rd = VersionReader(store, PREFIX)
    got, v = rd.fetch()  # late joiner: snapshot 3 is bad -> full version 1 + deltas 2, 3, 4
    assert v == 4 and same(got, h[3])
    assert rd.last_stats["versions"] == [1, 2, 3, 4]
    assert isinstance(rd.last_errors[0], CorruptData) and rd.last_errors[0].version == 3


def test_latest_fallback_is_the_newest_version_that_verifies(store: FileStore) -> None:
    """Replays the stale-weight fault of issue #16 in the reader: with a corrupt object in the chain
    to the newest version, a reader asked for "latest" either fails naming version and object or,
    allowed an older version, returns the newest one that verifies — never the keyframe (which the
    reader returned before). The corrupt object is tried once, not once per older version."""
    h = _history(store, n=6, k=100)  # full version 1, deltas 2..6
    shard = f"{PREFIX}/v00000004/d-0000.bin"
    p = store.root / shard
    good = p.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    rd = VersionReader(store, PREFIX)
    with pytest.raises(CorruptData) as err:
        rd.fetch()
    assert err.value.version == 4 and err.value.key == shard and shard in str(err.value)
    with pytest.raises(CorruptData):
        rd.fetch(5)  # an explicit target is never replaced either
    got, v = rd.fetch(allow_older=True)
    assert v == 3 and same(got, h[2]) and rd.last_stats["newest"] == 6
    assert [(e.version, e.key) for e in rd.last_errors] == [(4, shard)]  # versions 5 and 4 were skipped
    assert rd.last_stats["versions"] == [1, 2, 3]
    # the newest manifest unreadable: the next one down is the newest that verifies
    p.write_bytes(good)
    man = store.root / PREFIX / "v00000006" / "manifest.json.zst"
    blob = bytearray(man.read_bytes())
    blob[6] ^= 0x01  # inside the header
    man.write_bytes(bytes(blob))
    rd = VersionReader(store, PREFIX)
    with pytest.raises(ManifestError) as merr:
        rd.fetch()
    assert merr.value.version == 6 and merr.value.key == f"{PREFIX}/v00000006/manifest.json.zst"
    got, v = rd.fetch(allow_older=True)
    assert v == 5 and same(got, h[4])


def test_missing_object(store: FileStore) -> None:
    h = _history(store)
    _path(store, 3, "s-0000.bin").unlink()
    with pytest.raises(MissingObject) as err:
        VersionReader(store, PREFIX, strict=True).fetch(3)
    assert err.value.version == 3 and err.value.tensor and err.value.retryable
    got, v = VersionReader(store, PREFIX).fetch(3)
    assert v == 3 and same(got, h[2])


def test_wrong_base_detected_and_recovered(store: FileStore) -> None:
    h = _history(store)
    rd = VersionReader(store, PREFIX, strict=True)
    wrong, _ = rd.fetch(1)
    with pytest.raises(WrongBase) as err:
        rd.fetch(4, have=wrong, have_version=3)  # claims version 3, holds version 1
    assert err.value.tensor and err.value.version == 4
    got, v = VersionReader(store, PREFIX).fetch(4, have=wrong, have_version=3)
    assert v == 4 and same(got, h[3])


def test_corrupt_manifest(store: FileStore) -> None:
    _history(store, n=2)
    (store.root / PREFIX / "v00000002" / "manifest.json.zst").write_bytes(b"garbage")
    with pytest.raises(ManifestError) as err:
        VersionReader(store, PREFIX, strict=True).fetch(2)
    assert err.value.version == 2


def test_frames_carried_by_the_manifest(store: FileStore) -> None:
    """The last delta frames ride in the manifest object: a flipped byte inside them is a
    CorruptData naming version and tensor; a cut inside them or bytes appended after them (the
    manifest records how many bytes they are) a CorruptData naming the manifest object; a cut
    inside the header a ManifestError; the keyframe recovers either way."""
    h = _history(store, n=4, k=2)  # starts 1 (full), 3 (snapshot); deltas 2, 3, 4
    p = _path(store, 4, "manifest.json.zst")
    blob = p.read_bytes()
    man = VersionReader(store, PREFIX).manifest(4)
    assert blob[:4] == b"DLM2" and man.tail and "@manifest" in man.shards
    assert not (p.parent / "@manifest").exists()
    have, _ = VersionReader(store, PREFIX).fetch(3)
    bad = bytearray(blob)
    bad[-len(man.tail) // 2] ^= 0x10  # inside the carried frames
    p.write_bytes(bytes(bad))
    with pytest.raises(CorruptData) as err:
        VersionReader(store, PREFIX, strict=True).fetch(have={k: t.clone() for k, t in have.items()}, have_version=3)
    assert err.value.version == 4 and err.value.tensor
    key = f"{PREFIX}/v00000004/manifest.json.zst"
    p.write_bytes(blob[: len(blob) - len(man.tail) // 2])  # cut inside the carried frames
    with pytest.raises(CorruptData, match="truncated") as cut:
        VersionReader(store, PREFIX, strict=True).fetch(4)
    assert (cut.value.version, cut.value.key) == (4, key)
    p.write_bytes(blob + b"\0")  # a byte more than the manifest says it carries
    with pytest.raises(CorruptData, match="more than") as more:
        VersionReader(store, PREFIX, strict=True).fetch(4)
    assert (more.value.version, more.value.key) == (4, key)
    p.write_bytes(blob[:6])  # cut inside the header
    with pytest.raises(ManifestError):
        VersionReader(store, PREFIX, strict=True).fetch(4)
    rd = VersionReader(store, PREFIX)  # not strict: still the newest version, or a fault naming it
    with pytest.raises(ManifestError) as merr:
        rd.fetch()
    assert merr.value.version == 4 and merr.value.key == key
    got, v = rd.fetch(allow_older=True)  # accepted explicitly: the newest version that verifies
    assert v == 3 and same(got, h[2]) and rd.last_errors
    p.write_bytes(blob)
    got, v = VersionReader(store, PREFIX, strict=True).fetch(have=have, have_version=3)
    assert v == 4 and same(got, h[3])


_KILLED_PUBLISHER = r"""
import sys, time, torch
from infra.storage import FileStore
from infra.weightsync import VersionPublisher

class SlowStore(FileStore):  # a slow link: every PUT takes a while, so the kill lands mid-upload
    def put(self, key, data):
        time.sleep(0.3)
        super().put(key, data)

store = SlowStore(sys.argv[1])
pub = VersionPublisher(store, "runs/f/weights", snapshot_chain_fraction=100, chunk_bytes=16 << 10,
                       shard_bytes=16 << 10, io_threads=1)
g = torch.Generator().manual_seed(5)
pub.publish({"w": (torch.randn(400_000, generator=g)).to(torch.bfloat16)})
print("never", flush=True)
"""


@pytest.mark.slow
def test_publisher_killed_mid_upload(store: FileStore, tmp_path: Path) -> None:
    h = _history(store, n=2, k=100)
    script = tmp_path / "pub.py"
    script.write_text(_KILLED_PUBLISHER)
    proc = subprocess.Popen([sys.executable, str(script), str(store.root)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        v3 = store.root / PREFIX / "v00000003"
        deadline = time.monotonic() + 60
        while not (v3.is_dir() and any(v3.glob("*.bin"))):
            assert proc.poll() is None and time.monotonic() < deadline, "publisher ended before uploading"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert any(v3.glob("*.bin")) and not (v3 / "manifest.json.zst").exists()
    rd = VersionReader(store, PREFIX)
    assert rd.latest() == 2
    got, v = rd.fetch()
    assert v == 2 and same(got, h[1])
    # a new publisher continues after 2, cleans the orphan, and its version 3 is complete
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10)
    d = Drift()
    for _ in range(3):
        d.step()
    info = pub.publish(d.bf16())
    assert info.version == 3 and info.kind == "delta"
    got, v = rd.fetch(have=got, have_version=2)
    assert v == 3 and same(got, d.bf16())
