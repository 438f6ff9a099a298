"""Fuzz of what a reader takes from the store: manifests and frames written by the real publisher,
mutated (bit flips, cuts, huge, negative and wrong-typed numbers, swapped names and entries).

Replays finding 3 of issue #15 at scale: every mutated input is either decoded bit-exact to the
original or refused with the weight-sync error family; never another exception, never a hang (each
case runs under a timeout), and never a write outside the target: guard bytes around every output
buffer stay as they were, and a fetch writes nothing outside its output folder.

A seeded loop bounded in time (``DELTALOOP_FUZZ_SECONDS`` per target, default 10; ``DELTALOOP_FUZZ_SEED``,
default 15, picks another sequence): the cases are
the same sequence on every run; how many run depends on the machine. A failure prints the seed, the
case number and the mutation, which replay it.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from infra.storage import FileStore
from infra.weightsync import VersionPublisher, VersionReader, WeightSyncError, write_folder
from infra.weightsync import codec, kernels
from infra.weightsync.chunks import apply_frame
from infra.weightsync.layout import chunk_bounds, digest, manifest_key, snapshot_key, version_dir
from infra.weightsync.rawbytes import tensor_words
from tests.weightsync_helpers import Drift, manifest_blob, manifest_doc, same, word_pair

pytestmark = pytest.mark.slow

PREFIX = "runs/fuzz/weights"
SEED = int(os.environ.get("DELTALOOP_FUZZ_SEED", "15"))
SECONDS = float(os.environ.get("DELTALOOP_FUZZ_SECONDS", "10"))
CASE_TIMEOUT_S = 20.0
GUARD = 64  # guard words on each side of an output buffer
HUGE = [1 << 62, (1 << 64) - 1, 1 << 31, 10**30, -1, -(1 << 40), 0, 1]
ODD = ["", "../x", "/etc/passwd", "a/../../b", "x" * 3000, "\u00e9\0", None, True, 1.5, [], {}, [0, 0, 0, "0" * 32]]


def _bounded(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on a daemon thread; fail the test if it has not finished in ``CASE_TIMEOUT_S``
    (a hang), and re-raise what it raised."""
    box: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test thread below
            box.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(CASE_TIMEOUT_S)
    if th.is_alive():
        pytest.fail(f"{what}: no result after {CASE_TIMEOUT_S}s (a hang)")
    if box:
        raise box[0]


def _refused_or_exact(fn: Callable[[], None], what: str) -> bool:
    """Run one case; True if it was refused with a weight-sync error, False if it completed (the
    case itself then checked bit-exactness); any other exception fails the test."""
    try:
        _bounded(fn, what)
    except WeightSyncError:
        return True
    except pytest.fail.Exception:
        raise
    except BaseException as exc:  # the property under test: nothing else may come out
        pytest.fail(f"{what}: {type(exc).__name__}: {exc}")
    return False


# ------------------------------------------------------------------------------- manifests
@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> tuple[FileStore, list[dict[str, torch.Tensor]]]:
    """Versions 1 (full), 2 (delta, frames in shards and in the manifest), 3 (delta, and a snapshot)."""
    st = FileStore(tmp_path_factory.mktemp("fuzz") / "store")
    d = Drift()
    pub = VersionPublisher(st, PREFIX, snapshot_chain_fraction=100, chunk_bytes=16 << 10, delta_shard_bytes=2 << 10)
    out = []
    for v in (1, 2, 3):
        out.append(d.bf16())
        layout = {"model.safetensors": {"tensors": list(out[-1]), "metadata": {"format": "pt"}}}
        pub.publish(out[-1], files={"config.json": b'{"a": 1}', "tok/vocab.txt": b"a\nb\n"},
                    meta={"safetensors": layout}, snapshot=v == 3)
        d.step()
    pub.wait_snapshot()
    pub.close()
    return st, out


def _paths(node: Any, at: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys and indices) into a JSON value, the value itself first."""
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


def _mutate_doc(rng: random.Random, doc: dict[str, Any]) -> str:
    """Mutate the JSON document in place; returns what was done."""
    paths = _paths(doc)[1:]
    path = rng.choice(paths)
    parent, key = _get(doc, path[:-1]), path[-1]
    old = parent[key]
    how = rng.randrange(7)
    if how == 0:
        parent[key] = rng.choice(HUGE)
    elif how == 1:
        parent[key] = copy.deepcopy(rng.choice(ODD))
    elif how == 2 and isinstance(old, int) and not isinstance(old, bool):
        parent[key] = old + rng.choice([-1, 1, 2, -(old + 1), old, 1 << rng.randrange(8, 60)])
    elif how == 3:  # another value of the document (a swapped name, digest, location...)
        parent[key] = copy.deepcopy(_get(doc, rng.choice(paths)))
    elif how == 4 and isinstance(parent, dict):
        del parent[key]
    elif how == 5 and isinstance(old, list) and old:
        i, j = rng.randrange(len(old)), rng.randrange(len(old))
        old[i], old[j] = old[j], old[i]
        if rng.random() < 0.5:
            old.append(copy.deepcopy(old[i]))
        else:
            del old[rng.randrange(len(old))]
    elif how == 6 and isinstance(old, str) and old:
        i = rng.randrange(len(old))
        parent[key] = old[:i] + rng.choice("0f/.\\\0a") + old[i + 1 :]
    else:
        parent[key] = rng.choice(HUGE)
    return f"{'.'.join(map(str, path))} ({type(old).__name__}) via {how}"


def _mutate_bytes(rng: random.Random, blob: bytes) -> tuple[bytes, str]:
    """Byte-level mutation of a manifest object (header, compressed JSON or carried frames)."""
    b = bytearray(blob)
    how = rng.randrange(5)
    if how == 0:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif how == 1:
        b = b[: rng.randrange(len(b))]
    elif how == 2:
        b += rng.randbytes(rng.randint(1, 4096))
    elif how == 3:
        i = rng.randrange(len(b))
        b[i : i + 16] = rng.randbytes(16)
    elif blob[:4] == b"DLM2":
        b[4:8] = rng.choice([b"\xff\xff\xff\xff", b"\0\0\0\0", b"\x01\0\0\0"])
    return bytes(b), f"bytes via {how}"


def _guarded_like(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Copies of ``tensors`` living inside larger byte buffers with guard bytes on both sides."""
    out, bigs = {}, []
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        big = torch.full((n + 2 * GUARD,), 0xA5, dtype=torch.uint8)
        view = big[GUARD : GUARD + n]
        view.copy_(t.contiguous().reshape(-1).view(torch.uint8))
        out[k] = view.view(t.dtype).reshape(t.shape)
        bigs.append(big)
    return out, bigs


def _fetch_case(store: FileStore, history: list[dict[str, torch.Tensor]], v: int, outs: Path, via_have: bool,
                files: dict[str, bytes]) -> None:
    """Fetch version ``v`` (strict), its side files, and write the folder; every result must be the
    original. With ``via_have``: patch version ``v - 1`` in place, inside guarded buffers."""
    rd = VersionReader(store, PREFIX, threads=1, io_threads=2, strict=True, max_bytes=64 << 20)
    try:
        if via_have:
            have, bigs = _guarded_like(history[v - 2])
            try:
                got, gv = rd.fetch(v, have=have, have_version=v - 1, inplace=True)
            finally:
                for big in bigs:
                    assert bool((big[:GUARD] == 0xA5).all()) and bool((big[-GUARD:] == 0xA5).all()), \
                        "a fetch wrote outside the caller's tensors"
        else:
            got, gv = rd.fetch(v)
        assert gv == v and same(got, history[v - 1]), "accepted but not the original"
        side = rd.files(v)
        assert {digest(d) for d in side.values()} <= {digest(d) for d in files.values()}, "side file changed"
        write_folder(outs / "out", got, side, rd.manifest(v).meta)
    finally:
        rd.close()


def test_fuzz_manifests(history: tuple[FileStore, list[dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    """Mutated manifest objects (structure and bytes; the versions' and the snapshot's, which a
    fetch of version 3 starts from): refused with a weight-sync error, or every tensor bit-exact,
    nothing outside the output folder, no guard byte touched."""
    store, versions = history
    keys = {manifest_key(PREFIX, v): v for v in (1, 2, 3)} | {snapshot_key(PREFIX, 3): 3}
    originals = {k: store.get(k) for k in keys}
    files = {"config.json": b'{"a": 1}', "tok/vocab.txt": b"a\nb\n"}
    rng = random.Random(SEED)
    outs = tmp_path / "outs"
    before = sorted(p.relative_to(store.root).as_posix() for p in store.root.rglob("*"))
    cases = refused = 0
    deadline = time.monotonic() + SECONDS
    while time.monotonic() < deadline:
        key = rng.choice(sorted(keys))
        v = keys[key]
        if rng.random() < 0.75:
            doc, tail = manifest_doc(originals[key])
            what = _mutate_doc(rng, doc)
            if rng.random() < 0.2:
                what += "; " + _mutate_doc(rng, doc)
            blob = manifest_blob(doc, tail)
        else:
            blob, what = _mutate_bytes(rng, originals[key])
        via_have = v == 2 and rng.random() < 0.5
        store.put(key, blob)
        shutil.rmtree(outs, ignore_errors=True)
        outs.mkdir()
        what = f"seed {SEED} case {cases}: {key.rsplit('/', 2)[-2:]}, {what}"
        try:
            refused += _refused_or_exact(lambda: _fetch_case(store, versions, v, outs, via_have, files), what)
        finally:
            store.put(key, originals[key])
        assert [p.name for p in outs.iterdir()] in ([], ["out"]), f"{what}: wrote outside the output folder"
        out = (outs / "out").resolve()
        assert all(out in p.resolve().parents for p in out.rglob("*")), f"{what}: wrote outside the output folder"
        cases += 1
    after = sorted(p.relative_to(store.root).as_posix() for p in store.root.rglob("*"))
    assert after == before  # the reader wrote nothing into the store
    print(f"manifest fuzz: {cases} cases in {SECONDS:g}s, {refused} refused, {cases - refused} bit-exact")
    assert cases >= 50 and 0 < refused < cases, (cases, refused)


# ---------------------------------------------------------------------------------- frames
Frame = tuple[bytes, np.ndarray, np.ndarray]  # (frame, base words, expected words)


def _store_frames(store: FileStore, versions: list[dict[str, torch.Tensor]]) -> list[Frame]:
    """``(frame, base words, expected words)`` for every frame the publisher stored."""
    rd = VersionReader(store, PREFIX)
    out = []
    for v in (1, 2, 3):
        man = rd.manifest(v)
        for ti, t in enumerate(man.tensors):
            new = tensor_words(versions[v - 1][t.name])
            old = tensor_words(versions[v - 2][t.name]) if v > 1 else np.zeros_like(new)
            for ci, (s, e) in enumerate(chunk_bounds(len(new), new.dtype.itemsize, man.chunk_bytes)):
                for kind, loc in (("k", t.chunks[ci].k), ("d", t.chunks[ci].d)):
                    if loc is None:
                        continue
                    name = man.shards[loc[0]]
                    data = (man.tail[loc[1] : loc[1] + loc[2]] if name == "@manifest"
                            else store.get_range(f"{version_dir(PREFIX, v)}/{name}", loc[1], loc[2]))
                    out.append((data, (old if kind == "d" else np.zeros_like(new))[s:e].copy(), new[s:e].copy()))
    rd.close()
    return out


def _codec_frames() -> list[Frame]:
    """Frames of every codec and word width, plain and split position streams."""
    rng = np.random.default_rng(SEED)
    out = []
    for trial in range(24):
        old, new = word_pair(rng, trial)
        for name in ("sparse", "auto", "xor"):
            frame = codec.encode_delta(old, new, name, 1)[0]  # type: ignore[arg-type]
            if frame is not None:
                out.append((frame, old, new))
        out.append((codec.encode_raw(new, 1), old, new))
    return out


def _mutate_frame(rng: random.Random, frame: bytes) -> tuple[bytes, str]:
    """A mutated frame: bit flips, cuts, extensions, rewritten header or position-stream fields."""
    b = bytearray(frame)
    how = rng.randrange(8)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif how == 1:
        b = b[: rng.randrange(len(b))]
    elif how == 2:
        b += rng.randbytes(rng.randint(1, 64))
    elif how == 3:  # header: tag, word width, word count
        field = rng.randrange(3)
        if field == 0:
            b[0] = rng.randrange(256)
        elif field == 1:
            b[1] = rng.choice([0, 1, 2, 3, 4, 8, 16, 255])
        else:
            count = rng.choice([0, 1, (1 << 64) - 1, 1 << 62, int.from_bytes(b[2:10], "little") + 1])
            b[2:10] = count.to_bytes(8, "little")
    elif how == 4 and len(b) > 28:  # position stream: mode byte, then rice k, unary bits, count
        off = rng.choice([10, 11, 12, 20])
        width = {10: 1, 11: 1, 12: 8, 20: 8}[off]
        b[off : off + width] = rng.choice([0, 1, 63, 255, (1 << 63), (1 << 64) - 1]).to_bytes(8, "little")[:width]
    elif how == 5:
        i = rng.randrange(len(b))
        b[i : i + 8] = rng.randbytes(8)
    elif how == 6 and len(b) > 12:
        i = rng.randrange(len(b) - 1)
        del b[i : i + rng.randint(1, 8)]
    else:
        b = bytearray(rng.randbytes(rng.randint(0, 64)))
    return bytes(b), f"frame via {how}"


def _frame_case(frame: bytes, old: np.ndarray, new: np.ndarray, frame_h: str | None) -> None:
    """Apply ``frame`` to a guarded copy of ``old``: it must give exactly ``new`` or raise a
    weight-sync error, and leave the guard words alone either way."""
    big = np.empty(len(old) + 2 * GUARD, old.dtype)
    big.view(np.uint8)[:] = 0xA5
    sentinel = big[:GUARD].copy()
    buf = big[GUARD : GUARD + len(old)]
    buf[:] = old
    try:
        apply_frame(frame, buf, digest(new), frame_h=frame_h)
        assert np.array_equal(buf, new), "accepted but not the original words"
    finally:
        assert np.array_equal(big[:GUARD], sentinel) and np.array_equal(big[-GUARD:], sentinel), \
            "a decode wrote outside its buffer"


def test_fuzz_frames(history: tuple[FileStore, list[dict[str, torch.Tensor]]]) -> None:
    """Mutated frames through the decoder itself (frame digest off) on both implementations (numba
    and numpy) and, a few times, with the frame digest on: bit-exact or refused, guards intact."""
    store, versions = history
    frames = _store_frames(store, versions) + _codec_frames()
    impls = ["numba", "numpy"] if kernels.HAVE_NUMBA else ["numpy"]
    rng = random.Random(SEED)
    prev = kernels.implementation()
    cases = refused = 0
    deadline = time.monotonic() + SECONDS
    try:
        while time.monotonic() < deadline:
            frame, old, new = rng.choice(frames)
            mutated, what = _mutate_frame(rng, frame)
            impl = rng.choice(impls)
            kernels.set_implementation(impl)
            frame_h = digest(frame) if rng.random() < 0.1 else None
            refused += _refused_or_exact(lambda: _frame_case(mutated, old, new, frame_h),
                                         f"seed {SEED} case {cases}: {impl}, {what}, {len(old)} words of "
                                         f"{old.dtype.itemsize} bytes")
            cases += 1
    finally:
        kernels.set_implementation(prev)
    print(f"frame fuzz: {cases} cases in {SECONDS:g}s over {len(frames)} frames, {refused} refused, "
          f"{cases - refused} bit-exact")
    for frame, old, new in frames[:: max(1, len(frames) // 20)]:  # unmutated: always accepted
        _frame_case(frame, old, new, digest(frame))
    assert cases >= 200 and 0 < refused < cases, (cases, refused)
