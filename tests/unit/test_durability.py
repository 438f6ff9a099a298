"""Durability of what deltaloop writes to local disk: file-store objects and rewritten JSON files.

Replays the durability faults of issue #16 for real: a writer process killed with SIGKILL in the
middle of a large write (its temporary file left half-written next to the object it replaces), and
the leftovers such a writer leaves behind when the store is opened again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.atomicio import STALE_TEMP_S, TMP_PREFIX, is_temp_name, write_atomic, write_json_atomic
from infra.storage import FileStore

ROOT = Path(__file__).resolve().parents[2]

_PUT_CHILD = r"""
import sys
from infra.storage import FileStore
store = FileStore(sys.argv[1])
data = b"n" * int(sys.argv[2])
store.put("a/obj.bin", data)
"""

_JSON_CHILD = r"""
import sys
from infra.atomicio import write_json_atomic
write_json_atomic(sys.argv[1], {"payload": "n" * int(sys.argv[2])})
"""


def _temps(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)] if folder.exists() else []


def _kill_mid_write(script: str, args: list[str], folder: Path) -> Path:
    """Run ``script`` in a child, stop it (SIGSTOP) as soon as its temporary file exists in ``folder``
    (between the start of its write and its rename), then SIGKILL it. Returns the temporary file it
    left. Tries again if the child finished before it could be stopped."""
    for _ in range(5):
        child = subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            deadline = time.monotonic() + 60
            while not _temps(folder) and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            os.kill(child.pid, signal.SIGSTOP)
            temps = _temps(folder)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
            child.wait()
        if temps:
            return temps[0]
    raise AssertionError("the writer finished every time before it could be stopped mid-write")


def test_put_killed_between_write_and_rename_keeps_the_old_object(tmp_path: Path) -> None:
    """Replays the file-store fault of issue #16: a writer killed (SIGKILL) after it started writing
    the new bytes of an object and before the rename. The old object stays whole and readable, the
    half-written temporary file is never listed or readable as an object, a fresh one (a writer that
    may still be alive) survives an open, and one older than a minute is removed when a store opens."""
    root = tmp_path / "store"
    store = FileStore(root)
    old = os.urandom(1 << 16)
    store.put("a/obj.bin", old)
    tmp = _kill_mid_write(_PUT_CHILD, [str(root), str(512 << 20)], root / "a")
    assert tmp.exists() and is_temp_name(tmp.name)
    assert tmp.stat().st_size <= 512 << 20
    assert store.get("a/obj.bin") == old and store.size("a/obj.bin") == len(old)
    assert store.list("a/") == ["a/obj.bin"] and store.list() == ["a/obj.bin"]
    with pytest.raises(ValueError, match="temporary"):
        store.get(f"a/{tmp.name}")
    FileStore(root)  # a fresh temporary file may belong to a live writer in another process: kept
    assert tmp.exists()
    stale = time.time() - STALE_TEMP_S - 5
    os.utime(tmp, (stale, stale))
    FileStore(root)  # opening the store removes leftovers older than a minute
    assert not tmp.exists()
    assert store.get("a/obj.bin") == old
    store.put("a/obj.bin", b"new")
    assert store.get("a/obj.bin") == b"new" and not _temps(root / "a")


def test_json_rewrite_killed_mid_write_keeps_the_old_document(tmp_path: Path) -> None:
    """Replays the rewritten-in-place fault of issue #16 (summary.json, serve.json, pointers): a
    process killed while it rewrites a large JSON document leaves the previous document whole."""
    path = tmp_path / "state" / "serve.json"
    write_json_atomic(path, {"generation": 1})
    tmp = _kill_mid_write(_JSON_CHILD, [str(path), str(256 << 20)], path.parent)
    assert json.loads(path.read_text()) == {"generation": 1}
    assert tmp.parent == path.parent and is_temp_name(tmp.name)
    write_json_atomic(path, {"generation": 2}, indent=2)
    assert json.loads(path.read_text()) == {"generation": 2}


def test_write_atomic_modes_and_no_leftovers(tmp_path: Path) -> None:
    """A replaced file gets the permissions a plain create would give (or the mode asked for), and a
    write that fails leaves neither a temporary file nor a changed target."""
    path = tmp_path / "x" / "doc.txt"
    write_atomic(path, "one")
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    write_atomic(path, b"two", mode=0o600)
    assert path.read_bytes() == b"two" and path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(TypeError):
        write_json_atomic(path, {"not json": object()})
    assert path.read_bytes() == b"two" and not _temps(path.parent)


def test_keys_that_look_like_temporary_files_are_refused(tmp_path: Path) -> None:
    """A key whose last part carries the temporary prefix would be invisible to ``list`` and removed
    as a leftover: refused on every operation."""
    store = FileStore(tmp_path)
    for op in (lambda k: store.put(k, b"x"), store.get, store.exists, store.delete):
        with pytest.raises(ValueError, match="temporary"):
            op(f"a/{TMP_PREFIX}x")
