"""``infra.gcpause``: the cyclic collector stays off inside weight publish/fetch and comes back after."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

from infra.gcpause import deferred_gc, freeze_startup_objects
from infra.storage import FileStore
from infra.weightsync import VersionPublisher, VersionReader
from tests.weightsync_helpers import Drift, same


@pytest.fixture(autouse=True)
def _gc_on() -> None:
    gc.enable()
    yield
    gc.enable()


def test_nested_sections_reenable_only_after_the_last() -> None:
    with deferred_gc():
        assert not gc.isenabled()
        with deferred_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_exception_still_reenables() -> None:
    with pytest.raises(RuntimeError):
        with deferred_gc():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_process_that_had_gc_off_keeps_it_off() -> None:
    gc.disable()
    with deferred_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_sections_in_threads() -> None:
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with deferred_gc():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(10)
    with deferred_gc():
        pass
    assert not gc.isenabled()  # the other thread's section is still open
    release.set()
    t.join(10)
    assert gc.isenabled()


class _Watching(FileStore):
    """A file store that notes whether the collector was on at every call."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gc_on: list[bool] = []

    def put(self, key: str, data: bytes) -> None:
        self.gc_on.append(gc.isenabled())
        super().put(key, data)

    def get(self, key: str) -> bytes:
        self.gc_on.append(gc.isenabled())
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.gc_on.append(gc.isenabled())
        return super().get_range(key, start, length)


def test_publish_and_fetch_hold_off_the_collector(tmp_path: Path) -> None:
    store = _Watching(tmp_path / "s")
    d = Drift()
    pub = VersionPublisher(store, "w", snapshot_chain_fraction=100, chunk_bytes=16 << 10)
    rd = VersionReader(store, "w")
    pub.publish(d.bf16())
    have, hv = rd.fetch()
    d.step()
    want = d.bf16()
    pub.publish(want)
    got, v = rd.fetch(have=have, have_version=hv)
    assert v == hv + 1 and same(got, want)
    assert store.gc_on and not any(store.gc_on)  # every object read and written with the collector off
    assert gc.isenabled()  # and it is back on afterwards


def test_freeze_moves_objects_out_of_collections() -> None:
    before = gc.get_freeze_count()
    freeze_startup_objects()
    try:
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
