"""Packing frames into shard objects that upload in the background (publisher and snapshot lane).

Frames are appended in chunk order; a shard is uploaded on the given pool as soon as it holds
``shard_bytes`` (the caller bounds how many uploads it leaves queued in ``pending``). A frame's
location is ``[shard, offset, length, digest]`` with the shard index counted per :class:`Shards`
(the publisher shifts delta indices after the keyframe shards when it builds a manifest).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infra.storage import ObjectStore


class Shards:
    """Packs frames into shard objects named ``<tag>-0000.bin``... and uploads full ones on ``io``."""

    def __init__(self, store: "ObjectStore", vdir: str, tag: str, shard_bytes: int, io: ThreadPoolExecutor,
                 pending: deque[Future]) -> None:
        self.store, self.vdir, self.tag, self.limit = store, vdir, tag, shard_bytes
        self.io, self.pending = io, pending
        self.names: list[str] = []
        self.sizes: list[int] = []  # bytes of each shard
        self.parts: list[bytes] = []
        self.size = 0
        self.written = 0
        self.keys: list[str] = []  # objects submitted for upload (what to delete if abandoned)

    def add(self, frame: bytes, frame_h: str) -> list:
        """Append ``frame`` (whose digest is ``frame_h``); returns its ``[shard, offset, length,
        digest]`` (shard index per kind)."""
        if not self.parts:
            self.names.append(f"{self.tag}-{len(self.names):04d}.bin")
            self.sizes.append(0)
        loc = [len(self.names) - 1, self.size, len(frame), frame_h]
        self.parts.append(frame)
        self.size += len(frame)
        self.sizes[-1] = self.size
        if self.size >= self.limit:
            self.flush()
        return loc

    def take_tail(self, name: str) -> bytes:
        """The frames not yet uploaded, as shard ``name`` (carried by the manifest object)."""
        if not self.parts:
            return b""
        self.names[-1] = name
        tail = b"".join(self.parts)
        self.parts, self.size = [], 0
        return tail

    def flush(self) -> None:
        """Upload the frames gathered so far as one shard, in the background."""
        if not self.parts:
            return
        blob = b"".join(self.parts) if len(self.parts) > 1 else self.parts[0]
        key = f"{self.vdir}/{self.names[-1]}"
        self.keys.append(key)
        self.pending.append(self.io.submit(self.store.put, key, blob))
        self.written += len(blob)
        self.parts, self.size = [], 0
