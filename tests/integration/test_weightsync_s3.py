"""Weight sync against a real S3-protocol server (moto over loopback, from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file
from typer.testing import CliRunner

from infra.storage import S3Store
from infra.weightsync import MissingObject, VersionPublisher, VersionReader, collect
from tests.cli_helpers import cli_app
from tests.weightsync_helpers import Drift, same

PREFIX = "runs/s3/weights"


@pytest.fixture()
def store(s3_bucket: str, s3_endpoint: str) -> S3Store:
    return S3Store(s3_bucket, endpoint_url=s3_endpoint)


def test_publish_fetch_replay_gc_over_s3(store: S3Store) -> None:
    d = Drift(scale=8)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=32 << 10, shard_bytes=96 << 10)
    rd = VersionReader(store, PREFIX, range_bytes=64 << 10, budget_bytes=256 << 10)
    history = []
    have, hv = None, None
    for v in range(1, 8):
        history.append(d.bf16())
        info = pub.publish(history[-1], snapshot=v in (4, 7))  # snapshots in the background
        assert info.kind == ("keyframe" if v == 1 else "delta")
        have, hv = rd.fetch(have=have, have_version=hv)
        assert hv == info.version and same(have, history[-1])
        pub.wait_snapshot()
        d.step()
    pub.close()
    assert len([k for k in store.list(f"{PREFIX}/v00000001/") if k.endswith(".bin")]) > 1  # several shards
    late = VersionReader(store, PREFIX)
    got, v = late.fetch()
    assert v == 7 and same(got, history[-1]) and late.last_stats["versions"] == [7]
    got, v = late.fetch(5)
    assert same(got, history[4]) and late.last_stats["versions"] == [4, 5]
    assert collect(store, PREFIX, keep=2) == [1, 2, 3]
    assert VersionReader(store, PREFIX).versions() == [4, 5, 6, 7]
    # a publisher restarted against S3 continues from the newest version with a delta
    pub2 = VersionPublisher(store, PREFIX, chunk_bytes=32 << 10)
    assert pub2.publish(d.bf16()).kind == "delta"


def test_missing_object_over_s3(store: S3Store) -> None:
    d = Drift()
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10)
    for v in (1, 2, 3):
        pub.publish(d.bf16(), snapshot=v == 3)
        d.step()
    pub.close(wait_snapshot=True)
    store.delete(f"{PREFIX}/v00000003/s-0000.bin")
    with pytest.raises(MissingObject) as err:
        VersionReader(store, PREFIX, strict=True).fetch(3)
    assert err.value.version == 3 and err.value.tensor
    got, v = VersionReader(store, PREFIX).fetch()  # recovers: full version 1 + deltas 2, 3
    d2 = Drift()
    d2.step(), d2.step()
    assert v == 3 and same(got, d2.bf16())


def test_frames_a_manifest_carries_stream_in_over_s3(store: S3Store) -> None:
    """A delta that rides whole in its manifest object, larger than one piece of an S3 body: the
    reader gets the manifest with the frames still arriving (a :class:`StreamedTail`) and applies
    them bit-exact; a reader of a cut copy of the object gets the manifest object's CorruptData."""
    from infra.storage import RANGE_PIECE_BYTES
    from infra.weightsync import CorruptData
    from infra.weightsync.layout import manifest_key
    from infra.weightsync.tailstream import StreamedTail

    d = Drift(scale=32)
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=64 << 10)
    first = d.bf16()
    pub.publish(first)
    d.step(lr=2e-4)  # dense: most words change
    second = d.bf16()
    assert pub.publish(second).kind == "delta"
    pub.close()
    rd = VersionReader(store, PREFIX, strict=True)
    have, hv = rd.fetch(1)
    man = rd.manifest(2)
    assert man.shards == ["@manifest"] and len(man.tail) > RANGE_PIECE_BYTES  # two pieces or more
    assert isinstance(man.tail, StreamedTail)
    got, v = rd.fetch(None, have, hv)
    assert v == 2 and same(got, second) and man.tail.complete and not man.tail.failed
    key = manifest_key(PREFIX, 2)
    store.put(key, store.get(key)[:-1000])
    with pytest.raises(CorruptData, match="truncated") as err:
        VersionReader(store, PREFIX, strict=True).fetch(None, {k: t.clone() for k, t in first.items()}, 1)
    assert (err.value.version, err.value.key) == (2, key)


def test_cli_over_s3(s3_bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    from deltaloop.cli_sync import register

    app = cli_app(register)
    src = tmp_path / "src"
    src.mkdir()
    save_file(Drift().bf16(), str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    runner = CliRunner()
    res = runner.invoke(app, ["sync", "publish", str(src), "--store", s3_bucket, "--endpoint-url", s3_endpoint])
    assert res.exit_code == 0, res.output
    assert "version 1 (keyframe)" in res.output
    out = tmp_path / "out"
    res = runner.invoke(app, ["sync", "fetch", "--store", s3_bucket, "--endpoint-url", s3_endpoint, "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("model.safetensors", "config.json"):
        assert (src / name).read_bytes() == (out / name).read_bytes()
