"""File object store: atomic puts, listing, ranges, key validation, typed not-found errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.storage import FileStore, ObjectNotFound, get_json, open_store, put_json, run_key


def test_put_get_list_delete(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/s")
    assert isinstance(store, FileStore)
    store.put("a/b/c.bin", b"hello")
    store.put("a/d.bin", b"x" * 10)
    put_json(store, "a/e.json", {"k": [1, 2]})
    assert store.get("a/b/c.bin") == b"hello"
    assert store.get_range("a/d.bin", 2, 3) == b"xxx"
    assert store.size("a/d.bin") == 10
    assert store.list("a/") == ["a/b/c.bin", "a/d.bin", "a/e.json"]
    assert store.list("a/b") == ["a/b/c.bin"]
    assert get_json(store, "a/e.json") == {"k": [1, 2]}
    store.delete("a/d.bin")
    assert not store.exists("a/d.bin")
    store.delete("a/d.bin")  # idempotent


def test_missing_key_is_typed(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(ObjectNotFound) as info:
        store.get("nope/x")
    assert "nope/x" in str(info.value)
    assert info.value.retryable is False


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a", "a\\b"])
def test_bad_keys_rejected(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError):
        FileStore(tmp_path).put(key, b"")


def test_overwrite_is_atomic_no_temp_left(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    for i in range(5):
        store.put("k", bytes([i]) * 1000)
    assert store.get("k") == bytes([4]) * 1000
    assert store.list() == ["k"]


def test_run_key_layout() -> None:
    assert run_key("r1", 3, "rollouts.json") == "runs/r1/step-000003/rollouts.json"
    assert run_key("r1", None, "weights") == "runs/r1/weights"


def test_unknown_scheme() -> None:
    with pytest.raises(ValueError, match="known: file, s3"):
        open_store("gs://bucket/x")


@pytest.mark.parametrize("prefix", ["../", "..", "a/../../", "/etc/", "a//b", "a\\b", "./"])
def test_list_refuses_prefixes_that_leave_the_store(tmp_path: Path, prefix: str) -> None:
    """Replays a listing attack: a prefix with '..', an absolute path or odd segments must not walk
    outside the store's root (get/put/delete already refuse such keys)."""
    (tmp_path / "outside.txt").write_text("secret")
    store = FileStore(tmp_path / "root")
    store.put("a/b.txt", b"x")
    with pytest.raises(ValueError, match="invalid"):
        store.list(prefix)
    assert store.list("a/") == ["a/b.txt"] and store.list("") == ["a/b.txt"]


def test_list_does_not_follow_a_symlink_out_of_the_store(tmp_path: Path) -> None:
    """A symlinked folder inside the root that points outside it is not listed through."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "s.txt").write_text("secret")
    store = FileStore(tmp_path / "root")
    (tmp_path / "root" / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="outside the store"):
        store.list("link/")
