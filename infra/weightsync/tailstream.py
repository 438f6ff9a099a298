"""A version's manifest read as it arrives: its JSON first, the delta frames it carries after.

A delta smaller than a delta shard rides in the manifest object, after the JSON (``TAIL_SHARD``).
Read whole, those frames would decode only once the last byte of the object is in: on a 50 MB/s
link a 3 MB delta is then ~60 ms of download followed by all of its decode. :func:`open_manifest`
returns the manifest as soon as its JSON is in, with a :class:`StreamedTail` in place of the
frames, which a pool thread goes on filling from the same GET; the reader's pipeline decodes each
carried frame as soon as its bytes are there (:meth:`StreamedTail.wait` reports progress like a
download of a shard does), so decode overlaps the transfer.

A local store hands over the whole object at once: then the frames are plain ``bytes``, as from
:meth:`~infra.weightsync.layout.Manifest.from_bytes`. A stream cut short or longer than
the JSON declares is :class:`CorruptData` of the manifest object (its delta frames are unusable,
its keyframe frames are not: :mod:`infra.weightsync.recovery`), raised where the frames are needed
or, when every byte was in with the JSON, by :func:`open_manifest`; a storage error is raised
where the frames are needed, as it is, and the reader reads that manifest again next time.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator

from infra.storage import ObjectNotFound
from infra.weightsync.errors import CorruptData, ManifestError, MissingObject
from infra.weightsync.layout import (
    _TAIL_LEN,
    _TAIL_MAGIC,
    MAX_MANIFEST_OBJECT,
    Manifest,
    TAIL_SHARD,
    manifest_key,
    tail_start,
)

if TYPE_CHECKING:
    from infra.storage import ObjectStore


class StreamedTail:
    """The carried frames of one manifest object, ``size`` bytes, filled by :meth:`feed` on one
    thread while others :meth:`wait` for the bytes they need. Bytes once written never change."""

    def __init__(self, size: int, key: str, version: int) -> None:
        self.size, self.key, self.version = size, key, version
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._got = 0
        self._error: BaseException | None = None
        self._done = False
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, part: slice) -> bytes:
        """The bytes of ``part`` (waits for them): what slicing the plain ``bytes`` would give."""
        start, stop, _ = part.indices(self.size)
        return bytes(self.wait(start, max(stop - start, 0), None))

    @property
    def complete(self) -> bool:
        """Every byte is in (or the stream failed: :meth:`wait` raises the fault)."""
        return self._done

    def put(self, piece: bytes | bytearray) -> None:
        """Append ``piece``; too many bytes is the manifest object's fault."""
        with self._cond:
            end = self._got + len(piece)
            if end > self.size:
                raise CorruptData(f"manifest object carries more than the {self.size} bytes of frames its "
                                  "JSON declares", version=self.version, key=self.key)
            self._view[self._got : end] = piece
            self._got = end
            self._cond.notify_all()

    @property
    def failed(self) -> bool:
        """The stream ended with a fault: the manifest must be read again."""
        return self._error is not None

    def feed(self, pieces: Iterator[bytes], first: bytes = b"") -> None:
        """Put ``first`` and then the rest of the object's ``pieces`` (on a pool thread); the stream
        ends complete or with its fault kept for :meth:`wait`."""
        try:
            self.put(first)
            for piece in pieces:
                self.put(piece)
            if self._got != self.size:
                raise CorruptData(f"manifest object truncated: {self._got} of {self.size} bytes of carried "
                                  "frames", version=self.version, key=self.key)
        except ObjectNotFound:
            self._fail(MissingObject("manifest object gone while it was read", version=self.version, key=self.key))
        except BaseException as exc:  # kept for the threads that wait on the frames
            self._fail(exc)
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()
            close = getattr(pieces, "close", None)
            if close is not None:  # a generator left mid-body: let it close its connection
                close()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc

    def wait(self, start: int, length: int, arrived: Callable[[int, memoryview], None] | None) -> memoryview:
        """The ``length`` bytes from ``start``, once they are in; ``arrived(n, buf)`` hears of each
        part of them that comes in before the last (``buf``: a view of the whole part, its first
        ``n`` bytes in). Raises the stream's fault."""
        end = start + length
        if end > self.size:
            raise CorruptData(f"manifest carries {self.size} bytes of frames, a frame ends at {end}",
                              version=self.version, key=self.key)
        part = self._view[start:end]
        told = 0
        with self._cond:
            while True:
                if self._got >= end:
                    return part
                if self._error is not None:
                    raise self._error
                if self._done:  # (feed ends with an error when short; kept as a guard)
                    raise CorruptData("manifest object truncated", version=self.version, key=self.key)
                have = max(self._got - start, 0)
                if arrived is not None and have > told:
                    told = have
                    self._cond.release()
                    try:
                        arrived(have, part)
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait()


def open_manifest(store: "ObjectStore", prefix: str, version: int, max_bytes: int | None,
                  pool: ThreadPoolExecutor) -> Manifest:
    """The manifest of ``version``, returned once its JSON is in; carried frames still on their way
    come as a :class:`StreamedTail` that a task on ``pool`` fills. Raises ``ObjectNotFound`` when
    the object is absent and :class:`~infra.weightsync.errors.ManifestError` as
    :meth:`Manifest.from_bytes` does."""
    key = manifest_key(prefix, version)
    pieces = iter(store.iter_range(key, 0, MAX_MANIFEST_OBJECT + 1))
    head = bytearray()
    end: int | None = None
    for piece in pieces:
        head += piece
        if head[:4] != _TAIL_MAGIC[: len(head)]:
            continue  # no carried frames: the object is read whole
        end = end or tail_start(head, version)
        if end is not None and len(head) >= end:
            break
    else:  # the whole object is in
        return Manifest.from_bytes(bytes(head), version, max_bytes)
    assert end is not None
    man = Manifest.from_packed(bytes(head[4 + _TAIL_LEN.size : end]), b"", None, version, max_bytes)
    size = man.shard_sizes[man.shards.index(TAIL_SHARD)] if TAIL_SHARD in man.shards else 0
    if len(head) - end < size:  # frames still on their way: read on, on the pool
        man.tail = StreamedTail(size, key, version)
        pool.submit(man.tail.feed, pieces, bytes(head[end:]))
        return man
    head += b"".join(pieces)  # every carried byte is here (a local store reads in one piece)
    if len(head) > MAX_MANIFEST_OBJECT:
        raise ManifestError(f"manifest object larger than {MAX_MANIFEST_OBJECT} bytes", version=version)
    if len(head) - end > size:
        raise CorruptData(f"manifest object carries more than the {size} bytes of frames its JSON declares",
                          version=version, key=key)
    man.tail = bytes(head[end:])
    return man
