"""Same-cluster weight transport: trainer rank 0 broadcasts each version to the rollout workers.

For ``weight_sync.placement: broadcast`` the rollout workers and trainer rank 0 form a process group
of their own (rank 0 = the trainer, ranks 1.. = the workers), separate from the trainer's group: it
is built from a ``ProcessGroupGloo`` on a ``TCPStore`` that trainer rank 0 hosts
(:func:`open_rendezvous`), never through ``init_process_group``, so the trainer's default group,
its collectives and its failure handling are untouched, and the group can be thrown away and built
again when a worker or the trainer is replaced (a fresh store prefix per group).

One version on the wire (:meth:`Sender.send` / :meth:`Receiver.receive`, called at the same point on
every rank: they are collectives):

1. a header of 8 int64: magic, version, whether the sender holds that version, total bytes, the
   length of the layout, the bucket size, the bucket count, whether a digest trailer follows;
2. the layout (JSON: name, dtype, shape, byte offset of every tensor in one flat buffer);
3. the flat buffer in buckets of ``bucket_bytes`` (one broadcast each; the next bucket is on the
   wire while the previous one is hashed);
4. an xxh3-128 digest per bucket; a receiver whose bits differ raises
   :class:`~infra.weightsync.errors.CorruptData` and applies nothing.

The receiver receives straight into a flat buffer it keeps from version to version (no allocation
per version once the layout is known) and hands bf16 views of it to the engine. A receiver that
cannot use a version (its model's layout differs) still receives every bucket, into a scratch
bucket, so the sender never waits on a rank that left the collective; then it raises
:class:`BroadcastMismatch`. A peer that dies or stalls makes the collective fail within the
group's timeout (:class:`BroadcastFailed`, retryable) on the ranks still alive: nothing waits forever.

Bytes on the wire per version and reader: the full bf16 model plus a few KB (header, layout,
digests). It is the transport for one cluster's fast network; across regions the object store's
deltas are ~100x smaller (docs/weightsync.md).
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from infra.weightsync.errors import CorruptData, WeightSyncError
from infra.weightsync.rawbytes import dtype_from_name, dtype_name

if TYPE_CHECKING:
    import torch

MAGIC = 0x44_4C_42_43  # "DLBC"
BUCKET_BYTES = 32 << 20
_HEADER_LEN = 8
_DIGEST_LEN = 16
_ALIGN = 64


class BroadcastFailed(WeightSyncError):
    """The broadcast group failed: a peer died, stalled past the timeout, or could not join. The
    group is unusable; a fresh one (and the object store meanwhile) can deliver the version."""

    retryable = True


class BroadcastMismatch(WeightSyncError):
    """The sender's tensors do not fit the receiver's model (names, dtypes or shapes differ)."""


class BadGroupAddress(WeightSyncError):
    """A group address or rank that cannot be used (malformed, out of range)."""


# ------------------------------------------------------------------------------------ address
@dataclass(frozen=True)
class GroupAddress:
    """Where a broadcast group meets: the rendezvous store's host and port, the group's size, a
    random prefix (one group per prefix; it also keeps other clients of the store out of its keys)
    and the timeout of every collective."""

    host: str
    port: int
    world: int
    prefix: str
    timeout_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> "GroupAddress":
        """Parse and check an address sent over a control channel (:class:`BadGroupAddress` if not usable)."""
        if not isinstance(data, dict):
            raise BadGroupAddress(f"group address must be an object, got {type(data).__name__}")
        try:
            addr = cls(host=str(data["host"]), port=int(data["port"]), world=int(data["world"]),
                       prefix=str(data["prefix"]), timeout_s=float(data["timeout_s"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadGroupAddress(f"malformed group address {data!r}: {exc}") from None
        if not addr.host or not 0 < addr.port < 65536:
            raise BadGroupAddress(f"group address needs a host and a port in 1..65535, got {addr.host!r}:{addr.port}")
        if addr.world < 2:
            raise BadGroupAddress(f"a broadcast group needs the sender and at least one receiver (world {addr.world})")
        if not 0 < addr.timeout_s <= 86400:
            raise BadGroupAddress(f"group timeout must be in (0, 86400] seconds, got {addr.timeout_s}")
        if not addr.prefix.isalnum():
            raise BadGroupAddress(f"group prefix must be alphanumeric, got {addr.prefix!r}")
        return addr


@dataclass
class Rendezvous:
    """The store a group meets at, hosted by rank 0 (keep it as long as the group), and its address."""

    store: Any
    address: GroupAddress

    def close(self) -> None:
        """Drop this reference to the store (its listener closes once no group holds it either)."""
        self.store = None


def open_rendezvous(bind: str, advertise: str, world: int, timeout_s: float) -> Rendezvous:
    """Host the rendezvous store of a new group (trainer rank 0): a ``TCPStore`` on a socket bound
    here to ``bind`` (loopback on a local cluster: torch's own listener would take every interface),
    reached by the peers at ``advertise``."""
    import torch.distributed as dist

    from infra.proc import bind_socket

    if world < 2:
        raise BadGroupAddress(f"a broadcast group needs the sender and at least one receiver (world {world})")
    sock = bind_socket(bind, 0)
    port = int(sock.getsockname()[1])
    fd = sock.detach()  # the store owns the listening socket from here on (and closes it)
    try:
        store = dist.TCPStore(advertise, port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return Rendezvous(store, GroupAddress(advertise, port, world, secrets.token_hex(16), float(timeout_s)))


# -------------------------------------------------------------------------------------- group
class BroadcastGroup:
    """One rank of a broadcast group. Joining blocks until every rank joined (or the timeout)."""

    def __init__(self, address: GroupAddress, rank: int, host: str, store: Any = None) -> None:
        import torch.distributed as dist

        if not 0 <= rank < address.world:
            raise BadGroupAddress(f"rank {rank} outside the group's 0..{address.world - 1}")
        self.address, self.rank, self.world = address, rank, address.world
        self.timeout = datetime.timedelta(seconds=address.timeout_s)
        self._dist = dist
        try:
            if store is None:
                store = dist.TCPStore(address.host, address.port, None, False, timeout=self.timeout)
            self._store = store  # rank 0: the hosting store (kept alive here)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore(f"dlbc/{address.prefix}", store), rank, self.world, opts)
        except (RuntimeError, OSError, ValueError) as exc:
            raise BroadcastFailed(f"rank {rank} could not join the broadcast group at {address.host}:{address.port} "
                                  f"within {address.timeout_s:g}s: {_one_line(exc)}") from None
        self.closed = False

    def broadcast(self, tensor: "torch.Tensor", wait: bool = True) -> Any:
        """Broadcast ``tensor`` from rank 0 (in place on the others); the pending work when ``wait`` is false."""
        if self.closed:
            raise BroadcastFailed("the broadcast group is closed")
        opts = self._dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        try:
            work = self.pg.broadcast([tensor], opts)
        except RuntimeError as exc:
            raise self.failed(exc) from None
        if wait:
            self.wait(work)
        return work

    def wait(self, work: Any) -> None:
        """Wait for a pending broadcast; :class:`BroadcastFailed` when the group broke meanwhile."""
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise self.failed(exc) from None

    def failed(self, exc: BaseException) -> BroadcastFailed:
        """The group is over: close it and describe why (the peer's error text is kept out of the message
        beyond one line, so it reads as this group's failure and not the caller's own group's)."""
        self.close()
        return BroadcastFailed(f"broadcast group rank {self.rank}/{self.world}: a peer died or stalled "
                               f"(timeout {self.address.timeout_s:g}s): {_one_line(exc)}")

    def close(self) -> None:
        """Drop the group's connections (idempotent); a new group needs a new address."""
        if self.closed:
            return
        self.closed = True
        pg, self.pg = self.pg, None
        try:
            pg.abort()
        except (AttributeError, RuntimeError):
            pass
        del pg
        self._store = None


def _one_line(exc: BaseException) -> str:
    """The first line of an error, without the transport's markers that make the trainer treat an
    error as the failure of its *own* group (:func:`infra.train.worker._group_broken`)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    for marker in ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "Broken pipe"):
        text = text.replace(marker, marker.lower().replace(" ", "-").replace("/", "-"))
    return f"{type(exc).__name__}: {text}"


# ------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the flat buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout_of(tensors: dict[str, "torch.Tensor"], cast: Any = None) -> tuple[list[Slot], int]:
    """The flat layout of ``tensors`` (insertion order, offsets aligned to 64 bytes; in dtype ``cast``
    when given) and its size."""
    slots, off = [], 0
    for name, t in tensors.items():
        dtype = cast or t.dtype
        n = t.numel() * dtype.itemsize
        slots.append(Slot(name, dtype_name(dtype), tuple(t.shape), off, n))
        off += -(-n // _ALIGN) * _ALIGN
    return slots, off


def views(flat: "torch.Tensor", slots: list[Slot]) -> dict[str, "torch.Tensor"]:
    """Tensors over ``flat`` (uint8), one per slot, sharing its memory."""
    return {s.name: flat[s.offset : s.offset + s.nbytes].view(dtype_from_name(s.dtype)).view(s.shape) for s in slots}


def _bucket_ranges(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    return [(s, min(total, s + bucket_bytes)) for s in range(0, total, bucket_bytes)]


def _digest(buf: "torch.Tensor") -> bytes:
    return xxhash.xxh3_128_digest(memoryview(buf.numpy()))


def _stream(group: BroadcastGroup, flat: "torch.Tensor", ranges: list[tuple[int, int]],
            scratch: "torch.Tensor | None" = None) -> list[bytes]:
    """Broadcast ``flat`` bucket by bucket, each bucket hashed while the next one is on the wire;
    returns the bucket digests. With ``scratch`` (a receiver that drains a version it cannot use)
    every bucket lands in that one buffer and nothing is hashed."""
    digests: list[bytes] = []
    prev: "torch.Tensor | None" = None
    for s, e in ranges:
        buf = flat[s:e] if scratch is None else scratch[: e - s]
        work = group.broadcast(buf, wait=False)
        if prev is not None:
            digests.append(_digest(prev))
        group.wait(work)
        prev = buf if scratch is None else None
    if prev is not None:
        digests.append(_digest(prev))
    return digests


@dataclass
class Received:
    """What one :meth:`Receiver.receive` got: the version, whether the sender held it (if not, nothing
    else was sent), the tensors (views of the receiver's buffer), bytes on the wire and seconds."""

    version: int
    held: bool
    tensors: dict[str, "torch.Tensor"] | None
    bytes: int
    seconds: float


class Sender:
    """Rank 0 of a group: sends each version as one flat buffer (reused while the layout stays)."""

    def __init__(self, group: BroadcastGroup, bucket_bytes: int = BUCKET_BYTES) -> None:
        if group.rank != 0:
            raise BadGroupAddress(f"the sender is rank 0 of its group, not rank {group.rank}")
        if bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes must be at least 1024, got {bucket_bytes}")
        self.group, self.bucket_bytes = group, bucket_bytes
        self._flat: "torch.Tensor | None" = None
        self._slots: list[Slot] | None = None

    def send(self, version: int, tensors: dict[str, "torch.Tensor"] | None, cast: Any = None) -> dict[str, Any]:
        """Collective: send ``tensors`` (cast to dtype ``cast`` when given, as ``Tensor.to`` rounds) as
        ``version``; ``None`` tells the receivers that this trainer does not hold ``version`` (they
        take it from the object store). Returns bytes on the wire and seconds."""
        import torch

        t0 = time.perf_counter()
        if tensors is None:
            self.group.broadcast(torch.tensor([MAGIC, version, 0, 0, 0, 0, 0, 0], dtype=torch.int64))
            return {"version": version, "held": False, "bytes": 8 * _HEADER_LEN, "seconds": time.perf_counter() - t0}
        slots, total = layout_of(tensors, cast)
        if slots != self._slots or self._flat is None:
            self._flat, self._slots = torch.zeros(total, dtype=torch.uint8), slots
        with torch.no_grad():
            for s, view in views(self._flat, slots).items():
                view.copy_(tensors[s])
        layout = json.dumps([[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in slots]).encode()
        ranges = _bucket_ranges(total, self.bucket_bytes)
        header = [MAGIC, version, 1, total, len(layout), self.bucket_bytes, len(ranges), 1]
        self.group.broadcast(torch.tensor(header, dtype=torch.int64))
        self.group.broadcast(torch.frombuffer(bytearray(layout), dtype=torch.uint8))
        digests = _stream(self.group, self._flat, ranges)
        if digests:
            self.group.broadcast(torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8))
        sent = 8 * _HEADER_LEN + len(layout) + total + _DIGEST_LEN * len(digests)
        return {"version": version, "held": True, "bytes": sent, "raw_bytes": sum(s.nbytes for s in slots),
                "buckets": len(ranges), "seconds": time.perf_counter() - t0}

    def sent_tensors(self) -> dict[str, "torch.Tensor"]:
        """The tensors of the last version sent, as views of the flat buffer (no copy): valid until the
        next :meth:`send` writes into it."""
        if self._flat is None or self._slots is None:
            raise BroadcastFailed("nothing was sent yet")
        return views(self._flat, self._slots)


_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "uint8": 1, "int8": 1}


def parse_layout(blob: bytes, total: int) -> list[Slot]:
    """The layout a sender announced, checked against the buffer size (:class:`BroadcastMismatch`)."""
    try:
        rows = json.loads(blob)
        slots = [Slot(str(n), str(dt), tuple(int(x) for x in shape), int(off), int(nb)) for n, dt, shape, off, nb in rows]
    except (ValueError, TypeError) as exc:
        raise BroadcastMismatch(f"malformed layout from the sender: {exc}") from None
    for s in slots:
        numel = 1
        for x in s.shape:
            numel *= x
        if s.dtype not in _DTYPES or min(s.shape, default=1) < 0 or numel * _DTYPES[s.dtype] != s.nbytes \
                or s.offset < 0 or s.offset % _ALIGN or s.offset + s.nbytes > total:
            raise BroadcastMismatch(f"tensor {s.name!r}: slot {s} does not fit a {total}-byte buffer")
    return slots


class Receiver:
    """Rank >= 1 of a group: receives versions into one flat buffer kept between versions.

    ``max_bytes`` bounds what a sender may announce (nothing larger is allocated)."""

    def __init__(self, group: BroadcastGroup, max_bytes: int) -> None:
        if group.rank == 0:
            raise BadGroupAddress("rank 0 of a broadcast group sends; receivers are ranks 1..")
        self.group, self.max_bytes = group, max_bytes
        self._flat: "torch.Tensor | None" = None
        self._slots: list[Slot] | None = None

    def receive(self, version: int, expected: dict[str, tuple[str, tuple[int, ...]]] | None = None,
                drain: bool = False) -> Received:
        """Collective: receive the version the sender sends now, which must be ``version``.

        ``drain``: take part without keeping the bits (a version this receiver will not use); the
        result then has no tensors.

        ``expected``: name -> (dtype, shape) of the tensors this receiver can use; a layout that
        differs raises :class:`BroadcastMismatch` after the buckets were drained. Bits that do not
        match the sender's digests raise :class:`CorruptData`; either way the returned views are not
        to be used (the buffer may be half-written)."""
        import torch

        t0 = time.perf_counter()
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        self.group.broadcast(header)
        magic, got, held, total, layout_len, bucket, n_buckets, _ = (int(x) for x in header.tolist())
        if magic != MAGIC:
            raise self.group.failed(RuntimeError(f"bad header magic {magic:#x}: not a deltaloop broadcast peer"))
        if not held:
            return Received(got, False, None, 8 * _HEADER_LEN, time.perf_counter() - t0)
        blob = torch.zeros(layout_len, dtype=torch.uint8)
        self.group.broadcast(blob)
        ranges = _bucket_ranges(total, bucket)
        if len(ranges) != n_buckets or bucket < 1:
            raise self.group.failed(RuntimeError(f"inconsistent header {header.tolist()}"))
        problem = self._problem(version, got, total, blob.numpy().tobytes(), expected)
        scratch = torch.empty(min(bucket, total), dtype=torch.uint8) if problem or drain else None
        if scratch is None and (self._flat is None or self._flat.numel() != total):
            self._flat = torch.empty(total, dtype=torch.uint8)
        digests = _stream(self.group, self._flat if scratch is None else scratch, ranges, scratch)
        want = torch.zeros(_DIGEST_LEN * n_buckets, dtype=torch.uint8)
        if n_buckets:
            self.group.broadcast(want)
        size = 8 * _HEADER_LEN + layout_len + total + _DIGEST_LEN * n_buckets
        if problem:
            raise problem
        if drain:
            return Received(got, True, None, size, time.perf_counter() - t0)
        want_b = want.numpy().tobytes()
        bad = [i for i, d in enumerate(digests) if d != want_b[i * _DIGEST_LEN : (i + 1) * _DIGEST_LEN]]
        if bad:
            raise CorruptData(f"bucket(s) {bad[:5]} of {n_buckets} differ from the sender's digests", version=got)
        assert self._flat is not None and self._slots is not None
        return Received(got, True, views(self._flat, self._slots), size, time.perf_counter() - t0)

    def _problem(self, version: int, got: int, total: int, blob: bytes,
                 expected: dict[str, tuple[str, tuple[int, ...]]] | None) -> WeightSyncError | None:
        """Why this version cannot be taken (None: it can; the layout is kept in ``self._slots``)."""
        if got != version:
            return BroadcastMismatch(f"the sender sent version {got}, this receiver asked for {version}", version=version)
        if total > self.max_bytes:
            return BroadcastMismatch(f"the sender announced {total} bytes, above this receiver's bound of "
                                     f"{self.max_bytes}", version=got)
        try:
            slots = parse_layout(blob, total)
        except BroadcastMismatch as exc:
            return exc
        if expected is not None:
            have = {s.name: (s.dtype, s.shape) for s in slots}
            if have != expected:
                missing = sorted(set(expected) - set(have))[:5]
                extra = sorted(set(have) - set(expected))[:5]
                differ = sorted(n for n in set(have) & set(expected) if have[n] != expected[n])[:5]
                return BroadcastMismatch(f"the sender's tensors do not fit this model: missing {missing}, "
                                         f"extra {extra}, different dtype/shape {differ}", version=got)
        self._slots = slots
        return None

