"""Same-cluster transport: torch.distributed broadcast of deltas or full tensors.

For trainer and rollout ranks in one process group (gloo on CPU here, NCCL on GPUs) the object
store is an unnecessary hop. :class:`BroadcastSync` offers the publisher/reader pair of the object
store path on one collective: the source rank calls :meth:`BroadcastSync.publish`, every other rank
calls :meth:`BroadcastSync.fetch` at the same point (it is a collective: all ranks, same order).

Each round: all ranks all-gather the version they hold; if every receiver holds the source's
previous version the source broadcasts one packed buffer of delta frames (same frames and per-chunk
xxh3-128 digests as the store path), otherwise it broadcasts the full tensors uncompressed (on a
fast interconnect compression would cost more than it saves). Receivers verify every chunk digest,
so a rank that drifted fails loudly (:class:`WrongBase` / :class:`CorruptData`) instead of rolling
out with wrong weights; the next round then sends it full tensors.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from infra.weightsync.chunks import apply_frame, encode_chunk
from infra.weightsync.codec import CodecName
from infra.weightsync.errors import CorruptData, WrongBase
from infra.weightsync.layout import digest
from infra.weightsync.publisher import PublishInfo, chunk_bounds
from infra.weightsync.rawbytes import (
    bytes_to_tensor,
    dtype_from_name,
    dtype_name,
    tensor_bytes,
    tensor_words,
    word_dtype,
    word_width,
)

if TYPE_CHECKING:
    import torch


class BroadcastSync:
    """Version sync over a torch.distributed group; ``src`` publishes, the other ranks fetch."""

    def __init__(
        self,
        src: int = 0,
        group: Any = None,
        codec: CodecName = "auto",
        zstd_level: int = 1,
        threads: int = 2,
        *,
        chunk_bytes: int = 4 << 20,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (init_process_group first)")
        self.dist, self.src, self.group = dist, src, group
        self.codec, self.level, self.threads, self.chunk_bytes = codec, zstd_level, max(1, threads), chunk_bytes
        self.rank = dist.get_rank(group) if group is not None else dist.get_rank()
        self.version = 0
        self._base: dict[str, np.ndarray] | None = None
        self._digests: dict[str, list[str]] = {}
        self._sig: list[Any] = []

    # ----------------------------------------------------------------------------- plumbing
    def _bcast_bytes(self, data: bytes | None) -> bytes:
        import torch

        n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self.dist.broadcast(n, self.src, group=self.group)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        if self.rank == self.src and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if buf.numel():
            self.dist.broadcast(buf, self.src, group=self.group)
        return buf.numpy().tobytes()

    def _held_versions(self, mine: int) -> list[int]:
        import torch

        world = self.dist.get_world_size(self.group)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        self.dist.all_gather(out, torch.tensor([mine], dtype=torch.int64), group=self.group)
        return [int(t.item()) for t in out]

    # ------------------------------------------------------------------------------ source
    def publish(self, tensors: dict[str, "torch.Tensor"]) -> PublishInfo:
        """Source rank: send ``tensors`` as the next version (collective)."""
        import torch

        if self.rank != self.src:
            raise RuntimeError(f"publish() is for the source rank {self.src}; rank {self.rank} calls fetch()")
        t0 = time.perf_counter()
        held = self._held_versions(self.version)
        names = list(tensors)
        words = {n: tensor_words(tensors[n]) for n in names}
        sig = [(n, dtype_name(tensors[n].dtype), list(tensors[n].shape)) for n in names]
        receivers = [v for r, v in enumerate(held) if r != self.src]
        delta = self._base is not None and sig == self._sig and all(v == self.version for v in receivers)
        version = self.version + 1
        jobs = [(n, ci, s, e) for n in names
                for ci, (s, e) in enumerate(chunk_bounds(len(words[n]), words[n].dtype.itemsize, self.chunk_bytes))]
        base = self._base if delta else {n: np.empty_like(words[n]) for n in names}
        self._base = None
        prev_digests = self._digests

        def job(n: str, ci: int, s: int, e: int) -> Any:
            return encode_chunk(base[n][s:e] if delta else None, words[n][s:e], keyframe=False, codec=self.codec,
                                level=self.level, prev_digest=prev_digests[n][ci] if delta else None,
                                update_base=base[n][s:e])

        with ThreadPoolExecutor(self.threads) as pool:
            results = list(pool.map(lambda j: job(*j), jobs))
        frames = [r.delta or b"" for r in results] if delta else []
        digests: dict[str, list[str]] = {n: [] for n in names}
        for (n, _ci, _s, _e), r in zip(jobs, results):
            digests[n].append(r.digest)
        header = {"version": version, "kind": "delta" if delta else "full", "sig": sig, "digests": digests,
                  "base": prev_digests if delta else None,
                  "lengths": [len(f) for f in frames], "chunk_bytes": self.chunk_bytes}
        sent = len(self._bcast_bytes(json.dumps(header).encode()))
        if delta:
            sent += len(self._bcast_bytes(b"".join(frames)))
        else:
            for n in names:
                t = torch.from_numpy(tensor_bytes(tensors[n]).copy())
                if t.numel():
                    self.dist.broadcast(t, self.src, group=self.group)
                sent += t.numel()
        self._base, self._sig, self._digests, self.version = base, sig, digests, version
        changed = sum(r.changed for r in results)
        total = sum(e - s for _n, _c, s, e in jobs)
        return PublishInfo(version, "delta" if delta else "keyframe", sent,
                           sum(words[n].nbytes for n in names), time.perf_counter() - t0,
                           changed / total if total else 0.0)

    # ---------------------------------------------------------------------------- receivers
    def fetch(
        self, have: dict[str, "torch.Tensor"] | None = None, have_version: int | None = None, *, inplace: bool = False
    ) -> tuple[dict[str, "torch.Tensor"], int]:
        """Receiving rank: get the version the source publishes now (collective)."""
        import torch

        if self.rank == self.src:
            raise RuntimeError("fetch() is for receiving ranks; the source calls publish()")
        mine = have_version if (have is not None and have_version is not None) else -1
        self._held_versions(mine)
        header = json.loads(self._bcast_bytes(None))
        version, kind, sig = header["version"], header["kind"], header["sig"]
        bufs: dict[str, np.ndarray] = {}
        for n, dt, shape in sig:
            nbytes = dtype_from_name(dt).itemsize * int(np.prod(shape, dtype=np.int64))
            if kind == "delta":
                if have is None or n not in have:
                    raise WrongBase("a delta was sent but this rank holds no base", version=version, tensor=n)
                raw = tensor_bytes(have[n])
                bufs[n] = raw if inplace else raw.copy()
            else:
                bufs[n] = np.empty(nbytes, np.uint8)
        if kind == "delta":
            payload = memoryview(self._bcast_bytes(None))
        else:
            for n, _dt, _shape in sig:
                t = torch.from_numpy(bufs[n])
                if t.numel():
                    self.dist.broadcast(t, self.src, group=self.group)
        jobs = []
        off = 0
        lengths = iter(header["lengths"])
        for n, dt, _shape in sig:
            w = word_width(dtype_from_name(dt).itemsize)
            words = bufs[n].view(word_dtype(w))
            for ci, (s, e) in enumerate(chunk_bounds(len(words), w, header["chunk_bytes"])):
                if kind == "delta":
                    ln = next(lengths)
                    jobs.append((n, ci, words[s:e], payload[off : off + ln]))
                    off += ln
                else:
                    jobs.append((n, ci, words[s:e], None))

        def check(job: Any) -> None:
            n, ci, buf, frame = job
            want = header["digests"][n][ci]
            try:
                if frame is None or len(frame) == 0:
                    if digest(buf) != want:
                        raise ValueError("checksum mismatch")
                    return
                if digest(buf) != header["base"][n][ci]:
                    raise WrongBase(f"chunk {ci}: this rank's tensors are not version {version - 1}",
                                    version=version, tensor=n)
                apply_frame(frame, buf, want)
            except ValueError as exc:
                cls = WrongBase if kind == "delta" and not frame else CorruptData
                raise cls(f"chunk {ci}: {exc}", version=version, tensor=n) from exc

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(check, jobs))
        out: dict[str, "torch.Tensor"] = {}
        for n, dt, shape in sig:
            t = bytes_to_tensor(bufs[n], dtype_from_name(dt), tuple(shape))
            if inplace and have is not None and n in have:
                if have[n].data_ptr() != t.data_ptr():
                    have[n].copy_(t)
                t = have[n]
            out[n] = t
        return out, version
