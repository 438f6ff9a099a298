"""The reader's pipeline: download byte ranges of shards, decode their frames in version order.

A fetch replays steps (a keyframe, then deltas), each a set of frames in shard objects.
:func:`plan_ranges` turns the steps into byte ranges (adjacent frames of a shard merged up to
``range_bytes``, so a delta version is a few ranged GETs); :class:`DecodePipeline` downloads them on
the download pool with at most ``budget_bytes`` downloaded but not yet applied, and decodes a range
on the decode pool as soon as it has arrived and every earlier step is applied (a chunk's frames
must be applied in version order; frames of one step touch distinct chunks, so they decode in any
order and in parallel). A range's frames are handed to the decoders as its bytes arrive
(``download`` reports progress through the callback it is given): a delta that takes a link
~0.1 s to deliver is then mostly decoded by the time its last byte is in, instead of after.

Why the loop is built the way it is: completions arrive on one queue (futures' done-callbacks), so
it does O(1) work per finished download or decode; ``concurrent.futures.wait`` over every pending
future costs O(pending) per wake-up with the GIL held, which at ~220 frames a fetch is ~50 ms of
the scheduler's own Python that the decode threads wait on. A range is decoded in a few tasks, not
one per frame (each task and completion costs the GIL-holding loop ~30 us; a delta range holds ~80
small frames). Frames that came with the manifest and are all in (``inline`` ranges) are decoded
without a trip through a download thread: on a busy machine every hand-off between threads waits
for the GIL. Carried frames still arriving (:mod:`infra.weightsync.tailstream`) go through a
download thread like a shard's, so they too decode as their bytes come in.
"""

from __future__ import annotations

from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from queue import SimpleQueue
from threading import Lock
from typing import Callable

from infra.weightsync.errors import CorruptData, WeightSyncError
from infra.weightsync.layout import TAIL_SHARD, Manifest, version_dir
from infra.weightsync.pools import settle
from infra.weightsync.tailstream import StreamedTail

Step = tuple[int, str, Manifest]  # (version, "k" keyframe frames | "d" delta frames, its manifest)
Decode = Callable[[int, int, int, memoryview], None]  # (step, tensor, chunk, frame bytes)
Arrived = Callable[[int, memoryview], None]  # (bytes of the range in so far, the buffer holding them)
Download = Callable[["Range", Arrived], "bytes | memoryview"]


def counting(download: Download, total: int, report: Callable[[int, int], None]) -> Download:
    """``download`` that calls ``report(bytes done, total)`` after each range it returns (from
    whichever thread downloaded it; the calls are serialised, and the counts only grow)."""
    lock = Lock()
    done = [0]

    def counted(r: Range, arrived: Arrived) -> bytes | memoryview:
        data = download(r, arrived)
        with lock:
            done[0] += r.length
            report(done[0], total)
        return data

    return counted


@dataclass
class Range:
    """One ranged GET: ``length`` bytes of object ``key`` from ``start``, holding whole frames."""

    step: int
    key: str
    start: int
    length: int
    frames: list[tuple[int, int, int, int]] = field(default_factory=list)  # tensor, chunk, rel off, len
    carried: bool = False  # frames the manifest object carries (``TAIL_SHARD``)
    inline: bool = False  # carried frames already in: decoded on the calling thread, no download
    sent: int = 0  # frames handed to the decoders while the range was still downloading


def plan_ranges(steps: list[Step], prefix: str, range_bytes: int) -> list[Range]:
    """Byte ranges to download, in step order; adjacent frames of a shard merged up to ``range_bytes``.

    Raises :class:`CorruptData` when a keyframe step lacks a chunk's keyframe frame."""
    out: list[Range] = []
    for si, (v, kind, man) in enumerate(steps):
        per_shard: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
        for ti, t in enumerate(man.tensors):
            for ci, c in enumerate(t.chunks):
                loc = c.k if kind == "k" else c.d
                if loc is None:
                    if kind == "k":
                        raise CorruptData(f"chunk {ci} has no keyframe frame", version=v, tensor=t.name)
                    continue
                per_shard[loc[0]].append((loc[1], loc[2], ti, ci))
        for shard, frames in sorted(per_shard.items()):
            frames.sort()
            cur: Range | None = None
            for off, ln, ti, ci in frames:
                if cur is None or off != cur.start + cur.length or cur.length + ln > range_bytes:
                    name = man.shards[shard]
                    carried = name == TAIL_SHARD  # inline once they are all in (else still streaming)
                    inline = carried and not (isinstance(man.tail, StreamedTail) and not man.tail.complete)
                    cur = Range(si, f"{version_dir(prefix, v)}/{name}", off, 0, carried=carried, inline=inline)
                    out.append(cur)
                cur.frames.append((ti, ci, off - cur.start, ln))
                cur.length += ln
    return out


class DecodePipeline:
    """One fetch's downloads and decodes (see the module docstring); :meth:`run` drives it.

    ``download(range, arrived)`` returns the range's bytes (called on the download pool ``io``, or
    on the calling thread for inline ranges); while it runs it may call ``arrived(n, buf)``, from
    its thread, when the first ``n`` bytes of the range are in ``buf`` (which it must not change
    afterwards): the frames they complete are decoded at once. ``decode(step, tensor, chunk,
    frame)`` applies one frame (called on the decode pool ``cpu``). At most ``2 * io_threads``
    downloads run at once; a range's frames go to the decoders in tasks of up to 1/(4 * ``threads``)
    of them."""

    def __init__(self, ranges: list[Range], nsteps: int, download: Download,
                 decode: Decode,
                 io: ThreadPoolExecutor, cpu: ThreadPoolExecutor, io_threads: int, threads: int,
                 budget_bytes: int) -> None:
        self.download, self.decode = download, decode
        self.io, self.cpu = io, cpu
        self.io_threads, self.threads, self.budget_bytes = io_threads, threads, budget_bytes
        self.pending = deque(ranges)  # not yet started
        self.left_in_step = [0] * nsteps  # frames of each step not yet applied
        for r in ranges:
            self.left_in_step[r.step] += len(r.frames)
        self.left_in_range: dict[int, int] = {id(r): len(r.frames) for r in ranges}
        # frames downloaded whose step is not current yet: (range, its bytes, first frame, end frame)
        self.parked: dict[int, list[tuple[Range, bytes | memoryview, int, int]]] = defaultdict(list)
        # (kind, range, future, frames decoded) for "get"/"dec"; ("part", range, None, (lo, hi, buf))
        self.events: SimpleQueue[tuple[str, Range, Future | None, object]] = SimpleQueue()
        self.started: list[Future] = []
        self.downloading = self.outstanding = 0
        self.used = 0  # bytes downloaded (or downloading) and not yet applied
        self.current = 0  # the step being applied
        self.error: BaseException | None = None

    def run(self, prepare: Callable[[], None] | None = None) -> None:
        """Download and decode every range; raise the first error, after settling all work.

        ``prepare`` runs once, after the first downloads are on their way and before any decode."""
        try:
            self._advance()
            ready: list[Range] = []  # frames the manifest carried: no download, no thread hop
            while self.error is None and (self.pending or self.outstanding):
                self._start_downloads(ready)
                if prepare is not None:  # while the first ranges download
                    prepare()
                    prepare = None
                self._decode_inline(ready)
                if self.error is not None or not self.outstanding:
                    continue
                self._completed(*self.events.get())
        finally:
            settle(self.started)  # nothing left running that could still write into the buffers
        if prepare is not None and self.error is None:  # nothing was downloaded
            prepare()
        if self.error is not None:
            raise self.error

    def _start_downloads(self, ready: list[Range]) -> None:
        """Start downloads while under the limits; inline ranges go to ``ready`` instead."""
        pending = self.pending
        while pending and self.downloading < 2 * self.io_threads and (
            self.used == 0 or self.used + pending[0].length <= self.budget_bytes
        ):
            r = pending.popleft()
            self.used += r.length
            if r.inline:
                ready.append(r)
                continue
            self.downloading += 1
            self._track("get", r, self.io.submit(self.download, r, partial(self._progress, r)))

    def _progress(self, r: Range, got: int, buf: memoryview) -> None:
        """On ``r``'s download thread: the first ``got`` bytes are in; post the frames they complete."""
        frames, lo = r.frames, r.sent
        hi = lo
        while hi < len(frames) and frames[hi][2] + frames[hi][3] <= got:
            hi += 1
        if hi > lo:
            r.sent = hi
            self.events.put(("part", r, None, (lo, hi, buf)))

    def _decode_inline(self, ready: list[Range]) -> None:
        """Hand the inline ranges to the decoders now, while the other ranges download."""
        for r in ready:
            try:
                data = self.download(r, _ignore_progress)
            except WeightSyncError as exc:
                self.error = exc
                break
            self._arrived(r, data, 0, len(r.frames))
        ready.clear()

    def _completed(self, kind: str, r: Range, f: Future | None, extra: object) -> None:
        """A part of a range arrived, or one download or decode task finished: record it and move on."""
        if kind == "part":  # the download goes on: nothing finished
            lo, hi, buf = extra  # type: ignore[misc]
            self._arrived(r, buf, lo, hi)
            return
        assert f is not None
        self.outstanding -= 1
        exc = f.exception()
        if kind == "get":
            self.downloading -= 1
            if exc is not None:
                self.error = exc
            else:
                self._arrived(r, f.result(), r.sent, len(r.frames))
            return
        if exc is not None:
            self.error = exc
            return
        nframes = int(extra)  # type: ignore[call-overload]
        self.left_in_range[id(r)] -= nframes
        self.left_in_step[r.step] -= nframes
        if self.left_in_range[id(r)] == 0:
            self.used -= r.length
        self._advance()

    def _arrived(self, r: Range, data: bytes | memoryview, lo: int, hi: int) -> None:
        """Decode frames ``lo:hi`` of a range (their bytes in ``data``) now if its step is current,
        else park them until it is."""
        if lo >= hi:
            return
        if r.step == self.current:
            self._dispatch(r, data, lo, hi)
        else:
            self.parked[r.step].append((r, data, lo, hi))

    def _track(self, kind: str, r: Range, fut: Future, frames: int = 0) -> None:
        """Count ``fut`` as outstanding; its completion comes back on the event queue."""
        self.outstanding += 1
        self.started.append(fut)
        events = self.events
        fut.add_done_callback(lambda f: events.put((kind, r, f, frames)))

    def _decode_group(self, step: int, group: list[tuple[int, int, int, int]], mv: memoryview) -> None:
        """Decode task: apply a run of the frames of one range."""
        decode = self.decode
        for ti, ci, off, ln in group:
            decode(step, ti, ci, mv[off : off + ln])

    def _dispatch(self, r: Range, data: bytes | memoryview, lo: int, hi: int) -> None:
        """Split frames ``lo:hi`` of a range into decode tasks of up to 1/(4 * ``threads``) of the
        range's frames each (not one per frame: see the module docstring)."""
        mv = memoryview(data)
        per = -(-len(r.frames) // (4 * self.threads))
        for i in range(lo, hi, per):
            group = r.frames[i : min(i + per, hi)]
            self._track("dec", r, self.cpu.submit(self._decode_group, r.step, group, mv), len(group))

    def _advance(self) -> None:
        """Move to the next step once every frame of the current one is applied; start its parked ranges."""
        while self.current < len(self.left_in_step) and self.left_in_step[self.current] == 0:
            self.current += 1
            for r, data, lo, hi in self.parked.pop(self.current, []):
                self._dispatch(r, data, lo, hi)


def _ignore_progress(got: int, buf: memoryview) -> None:
    """The progress callback of an inline range: its bytes are all there already."""
