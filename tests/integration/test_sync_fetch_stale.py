"""``deltaloop sync fetch`` of "latest" when the newest version does not verify, through the real CLI.

Replays the stale-weight fault of issue #16 as a new user would meet it: six versions published
(one keyframe, five deltas), one byte of the newest manifest flipped, then a fetch without
``--version``. The fetch exits 1 naming the corrupt version and object and writes nothing; with
``--allow-older`` it writes the newest version that verifies (5), says so on stdout, and is
byte-identical to what was published as version 5 — never the keyframe.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import save_file

from infra.storage import FileStore
from infra.weightsync import VersionPublisher, read_folder
from infra.weightsync.layout import manifest_key, version_dir
from tests.weightsync_helpers import Drift

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "weights"


def _publish(tmp_path: Path, n: int, **pub_kwargs: int) -> tuple[FileStore, list[Path]]:
    """Versions 1..n of a drifting model, each also kept as the safetensors folder it came from."""
    store = FileStore(tmp_path / "store")
    pub = VersionPublisher(store, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, **pub_kwargs)
    d = Drift()
    folders = []
    for v in range(1, n + 1):
        src = tmp_path / f"src-{v}"
        src.mkdir()
        save_file(d.bf16(), str(src / "model.safetensors"), metadata={"format": "pt"})
        (src / "config.json").write_text('{"model_type": "llama", "v": %d}' % v)
        tensors, files, meta = read_folder(src)
        assert pub.publish(tensors, files=files, meta=meta).version == v
        folders.append(src)
        d.step(lr=1e-3)
    pub.close()
    return store, folders


def _flip(store: FileStore, key: str) -> None:
    path = store.root / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _fetch(store: FileStore, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DELTALOOP_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "deltaloop.cli", "sync", "fetch", "--store", store.uri,
                           "--out", str(out), *extra], cwd=out.parent, env=env, capture_output=True, text=True,
                          timeout=300)


def _same(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    got = sorted(p.name for p in b.iterdir() if p.name != ".deltaloop-sync.json")
    return names == got and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def _error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_corrupt_newest_manifest_fails_unless_older_is_allowed(tmp_path: Path) -> None:
    """Replays issue #16's stale-weight fault: 6 versions, one byte of the newest manifest flipped,
    ``sync fetch`` without ``--version``. On the code before, it exited 0 having written version 1
    (the keyframe), with the reason only on stderr."""
    store, folders = _publish(tmp_path, 6)
    bad = manifest_key(PREFIX, 6)
    _flip(store, bad)

    out = tmp_path / "out"
    line = _error_line(_fetch(store, out))
    assert "version 6" in line and bad in line and "--allow-older" in line
    assert not out.exists() or not any(out.iterdir())  # nothing written

    res = _fetch(store, out, "--allow-older")
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "version 5" in res.stdout and "newest committed version 6 does not verify" in res.stdout
    assert bad in res.stdout
    assert _same(folders[4], out)  # version 5, byte for byte: not the keyframe

    line = _error_line(_fetch(store, out, "--version", "6"))  # an explicit version is never replaced
    assert "version 6" in line and bad in line
    assert _same(folders[4], out)


def test_corrupt_delta_object_of_newest_names_the_object(tmp_path: Path) -> None:
    """Replays issue #16's stale-weight fault with the corruption in a delta shard of the newest
    version, fetched into a folder a previous fetch left at version 5: exit 1 naming version 6 and
    the shard; the folder keeps version 5 untouched; ``--allow-older`` keeps version 5 (nothing newer
    verifies) and says so."""
    store, folders = _publish(tmp_path, 6, delta_shard_bytes=2 << 10)
    out = tmp_path / "out"
    shard = next(k for k in store.list(version_dir(PREFIX, 6) + "/") if k.rsplit("/", 1)[1].startswith("d-"))
    _flip(store, shard)
    assert _fetch(store, out, "--version", "5").returncode == 0
    assert _same(folders[4], out)

    line = _error_line(_fetch(store, out))
    assert "version 6" in line and shard in line
    assert _same(folders[4], out)

    res = _fetch(store, out, "--allow-older")
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert "version 5" in res.stdout and shard in res.stdout
    assert _same(folders[4], out)
