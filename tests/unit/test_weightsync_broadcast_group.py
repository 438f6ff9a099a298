"""The broadcast group (:mod:`infra.weightsync.broadcast`) on gloo, with real processes: the bits
every receiver gets are the bits sent, a receiver that cannot use a version still lets the others
have it, and a peer that dies or stalls fails the collective within the group's timeout instead
of hanging it."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from infra.weightsync.broadcast import (BadGroupAddress, BroadcastFailed, BroadcastGroup, GroupAddress, Sender,
                                        open_rendezvous)
from tests.broadcast_helpers import fingerprint, receiver, versions


def _start(modes: list[str], timeout_s: float = 20.0) -> tuple[Any, Any, list[Any], Any]:
    """Trainer side: host the group, start one receiver process per mode, join as rank 0."""
    ctx = mp.get_context("spawn")
    q, inbox = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(inbox, i + 1, m, q), daemon=True) for i, m in enumerate(modes)]
    for p in procs:
        p.start()
    for _ in modes:
        assert q.get(timeout=120)[0] == "ready"
    rv = open_rendezvous("127.0.0.1", "127.0.0.1", 1 + len(modes), timeout_s)
    for _ in modes:
        inbox.put(rv.address.to_json())
    group = BroadcastGroup(rv.address, 0, "127.0.0.1", store=rv.store)
    for _ in modes:
        assert q.get(timeout=60)[0] == "joined"
    return rv, group, procs, q


def _stop(rv: Any, group: Any, procs: list[Any]) -> None:
    group.close()
    rv.close()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def test_receivers_get_the_bits_sent_bucket_by_bucket() -> None:
    rv, group, procs, q = _start(["ok", "ok"])
    v1, v2 = versions()
    master = {k: t.float() * 1.001 for k, t in v1.items()}  # fp32, cast by the sender as Tensor.to rounds
    try:
        sender = Sender(group, bucket_bytes=4096)  # ~5 buckets per version
        infos = [sender.send(1, v1), sender.send(2, v2), sender.send(3, None),
                 sender.send(4, master, cast=torch.bfloat16)]
        kept = sender.sent_tensors()  # the last version held, as views of the sender's buffer
        got = sorted((q.get(timeout=60) for _ in range(8)), key=lambda m: (m[1], m[2][0]))
    finally:
        _stop(rv, group, procs)
    assert infos[0]["buckets"] > 1 and infos[0]["held"] and not infos[2]["held"]
    for rank in (1, 2):
        mine = [m[2] for m in got if m[1] == rank]
        assert [m[0] for m in mine] == [1, 2, 3, 4]
        assert mine[0][1] == fingerprint(v1) and mine[1][1] == fingerprint(v2)
        assert mine[0][3] == infos[0]["bytes"]  # both ends count the same bytes on the wire
        assert mine[2][1] is None and mine[2][2] is False  # not held: nothing but the header
        assert mine[3][1] == fingerprint({k: t.to(torch.bfloat16) for k, t in master.items()})
    assert infos[0]["raw_bytes"] == sum(t.numel() * 2 for t in v1.values())
    assert fingerprint(kept) == fingerprint({k: t.to(torch.bfloat16) for k, t in master.items()})


def test_a_receiver_with_another_layout_fails_alone_and_stays_in_step() -> None:
    rv, group, procs, q = _start(["mismatch", "ok"])
    try:
        sender = Sender(group, bucket_bytes=4096)
        v1, v2 = versions()
        sender.send(1, v1)
        sender.send(2, v2)
        sender.send(3, None)
        sender.send(4, v1)
        msgs = [q.get(timeout=60) for _ in range(6)]
    finally:
        _stop(rv, group, procs)
    errors = [m for m in msgs if m[0] == "error"]
    assert len(errors) == 1 and errors[0][1] == 1 and "BroadcastMismatch" in errors[0][2]
    assert "missing ['other']" in errors[0][2]
    ok2 = [m[2] for m in msgs if m[0] == "got" and m[2][0] == 2]
    assert len(ok2) == 2 and all(p[1] == fingerprint(v2) for p in ok2)  # the mismatched one too, next version


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_a_dead_or_stalled_receiver_fails_the_send_within_the_timeout(mode: str) -> None:
    timeout = 3.0
    rv, group, procs, _q = _start([mode], timeout_s=timeout)
    big = {"w": torch.zeros(8 << 20, dtype=torch.bfloat16)}  # 16 MB: more than the socket buffers hold
    try:
        t0 = time.monotonic()
        with pytest.raises(BroadcastFailed, match="peer died or stalled"):
            for v in range(1, 4):
                Sender(group).send(v, big) if v == 1 else None
        took = time.monotonic() - t0
    finally:
        _stop(rv, group, procs)
    assert took < timeout + 10
    assert group.closed  # a failed group is closed: the next version needs a fresh one


def test_a_receiver_whose_sender_died_fails_within_the_timeout() -> None:
    timeout = 3.0
    rv, group, procs, q = _start(["wait"], timeout_s=timeout)
    group.close()  # the sender goes away without sending
    rv.close()
    kind, _rank, text = q.get(timeout=timeout + 30)
    for p in procs:
        p.join(timeout=10)
    assert kind == "error" and "BroadcastFailed" in text


@pytest.mark.parametrize("bad, why", [
    ({"host": "127.0.0.1", "port": 0, "world": 2, "prefix": "ab", "timeout_s": 1}, "port"),
    ({"host": "127.0.0.1", "port": 5, "world": 1, "prefix": "ab", "timeout_s": 1}, "at least one receiver"),
    ({"host": "127.0.0.1", "port": 5, "world": 2, "prefix": "a/b", "timeout_s": 1}, "alphanumeric"),
    ({"host": "127.0.0.1", "port": 5, "world": 2, "prefix": "ab", "timeout_s": 0}, "timeout"),
    ({"host": "127.0.0.1", "world": 2}, "malformed"),
    ("127.0.0.1:5", "must be an object"),
])
def test_bad_group_addresses_are_refused(bad: Any, why: str) -> None:
    with pytest.raises(BadGroupAddress, match=why):
        GroupAddress.from_json(bad)


def test_joining_a_group_nobody_hosts_fails_within_the_timeout() -> None:
    from infra.proc import free_port

    addr = GroupAddress("127.0.0.1", free_port(), 2, "ab12", 2.0)
    t0 = time.monotonic()
    with pytest.raises(BroadcastFailed, match="could not join"):
        BroadcastGroup(addr, 1, "127.0.0.1")
    assert time.monotonic() - t0 < 30
