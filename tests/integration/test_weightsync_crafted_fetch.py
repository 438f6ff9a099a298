"""``deltaloop sync fetch`` of a crafted version, through the real CLI in a subprocess: it exits 1 with
one ``error:`` line naming the manifest field, and writes nothing outside ``--out`` (nor inside it).

Replays findings 2 and 3 of issue #15 as an attacker with write access to the store would: a
version whose manifest names files outside the output folder, declares absurd sizes, points a
frame far past its shard, or names object keys outside its version folder.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file

from infra.storage import FileStore
from infra.weightsync import VersionPublisher, read_folder
from infra.weightsync.layout import manifest_key
from tests.weightsync_helpers import Drift, manifest_blob, manifest_doc

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "weights"


def _absurd(doc: dict[str, Any]) -> None:
    """An 8 TiB tensor that is consistent with itself (shape x itemsize = nbytes, one chunk entry
    per 256 MiB): on the code before the checks, ``np.empty`` of it raised MemoryError."""
    doc["chunk_bytes"] = 256 << 20
    for t in doc["tensors"]:
        t["chunks"] = t["chunks"][:1]
    big = next(t for t in doc["tensors"] if t["dtype"] == "bfloat16")
    big["shape"], big["nbytes"] = [1 << 42], 1 << 43
    big["chunks"] = big["chunks"] * (1 << 15)


def _traversing_names(doc: dict[str, Any]) -> None:
    layout = doc["meta"]["safetensors"]
    doc["meta"]["safetensors"] = {"../../escape.safetensors": next(iter(layout.values()))}
    doc["files"] = {"../escape.json": next(iter(doc["files"].values()))}


def _names_and_sizes(doc: dict[str, Any]) -> None:
    _traversing_names(doc)
    _absurd(doc)


def _overlong_name(doc: dict[str, Any]) -> None:
    """A safetensors file name with a 300-character segment: the file system refuses it half-way
    through writing (an OSError and a traceback on the code before)."""
    layout = doc["meta"]["safetensors"]
    doc["meta"]["safetensors"] = {"x" * 300 + ".safetensors": next(iter(layout.values()))}


def _frame_past_its_shard(doc: dict[str, Any]) -> None:
    """Chunk 1 of the first tensor of several chunks: a 64 GiB frame (the code before read it)."""
    next(t for t in doc["tensors"] if len(t["chunks"]) > 1)["chunks"][1]["k"][2] = 1 << 36


def _key_outside_the_version(doc: dict[str, Any]) -> None:
    doc["shards"][0] = "../../elsewhere/k-0000.bin"


CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("names-and-sizes", _names_and_sizes, "nbytes"),
    ("absurd-size", _absurd, "nbytes"),
    ("overlong-name", _overlong_name, "meta.safetensors"),
    ("frame-past-shard", _frame_past_its_shard, ".chunks[1].k"),
    ("key-outside-version", _key_outside_the_version, "shards[0]"),
]


def _tree(root: Path, skip: set[Path]) -> list[str]:
    """Every path under ``root`` except those under ``skip``."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if not any(s == p or s in p.parents for s in skip))


@pytest.mark.parametrize("name,edit,field", CASES, ids=[c[0] for c in CASES])
def test_sync_fetch_refuses_a_crafted_version(tmp_path: Path, name: str, edit: Callable[[dict[str, Any]], None],
                                              field: str) -> None:
    """Replays finding 3 (absurd sizes, a frame past its shard, a key outside the version) and
    finding 2 (file names outside ``--out``) of issue #15 through ``deltaloop sync fetch``: exit 1,
    one line naming the field, no traceback, nothing written anywhere."""
    src = tmp_path / "src"
    src.mkdir()
    tensors = Drift().bf16()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text('{"model_type": "llama"}')
    store = FileStore(tmp_path / "store")
    pub = VersionPublisher(store, PREFIX, chunk_bytes=16 << 10)
    t, files, meta = read_folder(src)
    pub.publish(t, files=files, meta=meta)
    pub.close()
    doc, tail = manifest_doc(store.get(manifest_key(PREFIX, 1)))
    doc = copy.deepcopy(doc)
    edit(doc)
    store.put(manifest_key(PREFIX, 1), manifest_blob(doc, tail))

    out = tmp_path / "a" / "b" / "out"  # '../escape.json' would land in a/b, '../../..' in a
    out.parent.mkdir(parents=True)
    before = _tree(tmp_path, {out})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("DELTALOOP_DEBUG", None)
    res = subprocess.run([sys.executable, "-m", "deltaloop.cli", "sync", "fetch", "--store", store.uri,
                          "--version", "1", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 1, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and field in lines[0], res.stderr
    assert "version 1" in lines[0] and "Traceback" not in res.stderr
    assert _tree(tmp_path, {out}) == before  # nothing written outside --out (nor in the store)
    assert not out.exists() or not any(out.rglob("*"))  # refused before anything was written
    assert not list(tmp_path.rglob("escape*"))
    assert torch.equal(tensors["embed.weight"], read_folder(src)[0]["embed.weight"])  # source untouched
