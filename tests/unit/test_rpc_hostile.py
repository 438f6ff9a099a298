"""Finding 5 of issue #15, replayed: hostile peers against the trainer's control channel.

Each test runs a real :class:`infra.rpc.RpcServer` on loopback, served in a thread the way rank 0
serves it (``next_command`` / ``reply``), attacks it over real sockets, and then checks that the
genuine client (``RpcClient``, holding the key) is still served and that nothing the attacker sent
was executed. Attackers speak the wire format of the ``infra.rpc`` module docstring from scratch
(:func:`_handshake`, :func:`_sealed`), so a key holder's raw frames can be forged as well.

On the code before this change (``multiprocessing.connection``: pickles, ``accept()`` once, no
deadlines) the wrong-key, garbage and oversized peers raised out of ``accept()`` and killed the
listener, a silent peer held it for ever, the client handshake had no deadline, and whatever came
after the handshake was unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import socket
import struct
import threading
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from infra.rpc import (MAX_MESSAGE, PROTOCOL, ChannelError, RpcClient, RpcServer, ServiceDied, open_channel,
                       publish_address)
from infra.storage import FileStore

KEY = b"r" * 32
WRONG = b"w" * 32


def _alive() -> None:
    return None


# ------------------------------------------------------------------------- the wire, by hand
def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _read_frame(sock: socket.socket) -> bytes:
    return _read_exact(sock, struct.unpack(">I", _read_exact(sock, 4))[0])


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _sealed(session: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    """An authenticated message as the module docstring defines it."""
    return _frame(_mac(session, direction + struct.pack(">Q", seq) + body) + body)


def _handshake(sock: socket.socket, key: bytes) -> bytes:
    """The client handshake written from the protocol description; returns the session key."""
    nc = os.urandom(32)
    sock.sendall(_frame(json.dumps({"proto": PROTOCOL, "nonce": nc.hex()}).encode()))
    ns = bytes.fromhex(json.loads(_read_frame(sock))["nonce"])
    label = PROTOCOL.encode() + b"|"
    sock.sendall(_frame(json.dumps({"proof": _mac(key, label + b"client|" + nc + ns).hex()}).encode()))
    session = _mac(key, label + b"session|" + nc + ns)
    assert _read_frame(sock) == _sealed(session, b"S", 0, b'{"ok":true}')[4:]
    return session


def _closed_by_server(sock: socket.socket, within_s: float = 5.0) -> bool:
    """True once the server has closed ``sock`` (EOF or reset), reading and discarding what it sent."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


# ---------------------------------------------------------------------------- the service
@dataclass
class Service:
    """A served RpcServer, its store, and every command it executed."""

    store: FileStore
    server: RpcServer
    handled: list[dict[str, Any]] = field(default_factory=list)

    def call(self, timeout_s: float = 10.0, **kwargs: Any) -> None:
        """The genuine client: connect (retrying, as the flow does) and run one command."""
        client = RpcClient.connect(self.store, "ctl.json", KEY, timeout_s, alive=_alive)
        try:
            assert client.call("ping", alive=_alive, timeout_s=timeout_s, **kwargs) == {"echo": {"op": "ping", **kwargs}}
        finally:
            client.close()


@pytest.fixture()
def make_service(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    servers: list[RpcServer] = []
    threads: list[threading.Thread] = []

    def make(**kwargs: Any) -> Service:
        svc = Service(FileStore(tmp_path / f"store{len(servers)}"), RpcServer(KEY, "127.0.0.1", **kwargs))
        servers.append(svc.server)
        publish_address(svc.store, "ctl.json", "127.0.0.1", svc.server.port)

        def serve() -> None:  # rank 0's loop (infra/train/worker.py main)
            while True:
                cmd = svc.server.next_command(None)
                if cmd["op"] == "shutdown":  # the fixture closed the server
                    return
                svc.handled.append(cmd)
                svc.server.reply({"echo": cmd})

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        threads.append(thread)
        return svc

    yield make
    for server in servers:
        server.close()
    for thread in threads:  # every log line of the loop lands inside this test, none after it
        thread.join(10)
        assert not thread.is_alive()


def _wait_refused(svc: Service, n: int, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while svc.server.refused < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.server.refused >= n, f"{svc.server.refused} refusals, expected {n}"


# ------------------------------------------------------------------------------- the attacks
def test_wrong_key_peer_leaves_the_service_serving(make_service: Callable[..., Service]) -> None:
    """Finding 5: a peer with the wrong key killed rank 0's listener (AuthenticationError out of
    accept()). Now it is refused quickly, on both ends, and the real client is served."""
    svc = make_service()
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="did not prove"):
        open_channel("127.0.0.1", svc.server.port, WRONG, timeout_s=5)
    assert time.monotonic() - t0 < 2
    with _connect(svc.server.port) as sock:  # a key-less peer that goes on to send a forged proof
        with pytest.raises(EOFError):
            _handshake(sock, WRONG)
    _wait_refused(svc, 2)
    svc.call(n=1)
    assert svc.handled == [{"op": "ping", "n": 1}]


def test_silent_peers_neither_block_nor_stay(make_service: Callable[..., Service]) -> None:
    """Finding 5: a peer that connects and sends nothing blocked rank 0 in accept() for ever. Now the
    real client is served while silent peers are connected, and each is closed at its deadline."""
    svc = make_service(handshake_timeout_s=2.0)
    silent = [_connect(svc.server.port) for _ in range(8)]
    t0 = time.monotonic()
    svc.call(n=1)
    assert time.monotonic() - t0 < 1.5  # not serialised behind the silent peers' deadlines
    assert all(_closed_by_server(s, within_s=5) for s in silent)
    _wait_refused(svc, 8)
    svc.call(n=2)
    assert [c["n"] for c in svc.handled] == [1, 2]
    for s in silent:
        s.close()


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST


BAD_PEERS: dict[str, Callable[[socket.socket], None]] = {
    "garbage": lambda s: s.sendall(os.urandom(4096)),
    "pickle": lambda s: s.sendall(_frame(pickle.dumps({"op": "ping"}))),
    "http": lambda s: s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
    "json-list": lambda s: s.sendall(_frame(b"[1, 2, 3]")),
    "bad-nonce": lambda s: s.sendall(_frame(json.dumps({"proto": PROTOCOL, "nonce": "zz"}).encode())),
    "other-protocol": lambda s: s.sendall(_frame(json.dumps({"proto": "x/9", "nonce": "00" * 32}).encode())),
    "truncated": lambda s: s.sendall(struct.pack(">I", 100) + b"{" * 10),
    "reset": lambda s: (s.sendall(_frame(json.dumps({"proto": PROTOCOL, "nonce": "00" * 32}).encode())), _reset(s)),
}


@pytest.mark.parametrize("kind", sorted(BAD_PEERS))
def test_garbage_peers_leave_the_service_serving(make_service: Callable[..., Service], kind: str) -> None:
    """Finding 5: garbage bytes (or a bad length) raised 'bad message length' out of accept() and
    killed rank 0's listener. Now each is refused with a log line and the real client is served."""
    svc = make_service()
    with _connect(svc.server.port) as sock:
        BAD_PEERS[kind](sock)
    _wait_refused(svc, 1)
    svc.call(kind=kind)
    assert svc.handled == [{"op": "ping", "kind": kind}]


def test_oversized_length_prefix_is_refused_before_allocation(make_service: Callable[..., Service]) -> None:
    """Finding 5: a length prefix is read before anything is authenticated; a 4 GiB claim must be
    refused by its number, both before the handshake and from a key holder after it."""
    svc = make_service()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for claim in (0xFFFFFFFF, 1 << 20, 1025):  # before the handshake the limit is 1 KiB
            with _connect(svc.server.port) as sock:
                sock.sendall(struct.pack(">I", claim))
                assert _closed_by_server(sock)
        for claim in (0xFFFFFFFF, MAX_MESSAGE + 1):
            with _connect(svc.server.port) as sock:
                _handshake(sock, KEY)
                sock.sendall(struct.pack(">I", claim))
                assert _closed_by_server(sock)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated while refusing"
    _wait_refused(svc, 3)
    svc.call(n=1)
    assert svc.handled == [{"op": "ping", "n": 1}]


Mutate = Callable[[int, bytes, dict[str, list[bytes]]], list[bytes]]


def _as_is(i: int, frame: bytes, seen: dict[str, list[bytes]]) -> list[bytes]:
    return [frame]


class _Proxy:
    """A man in the middle between the real client and the server, without the key.

    Each message passes through ``c2s`` or ``s2c`` (its index in that direction, the raw frame, the
    frames seen so far in both directions) -> the frames to send on instead."""

    def __init__(self, port: int, c2s: Mutate = _as_is, s2c: Mutate = _as_is) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = port
        self.mutate = {"c2s": c2s, "s2c": s2c}
        self.seen: dict[str, list[bytes]] = {"c2s": [], "s2c": []}
        threading.Thread(target=self._run, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while True:
                frame = _read_exact(src, 4)
                frame += _read_exact(src, struct.unpack(">I", frame)[0])
                self.seen[way].append(frame)
                for out in self.mutate[way](len(self.seen[way]) - 1, frame, self.seen):
                    dst.sendall(out)
        except (EOFError, OSError):
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self._pump, args=(server, client, "s2c"), daemon=True).start()
        self._pump(client, server, "c2s")


def _flip_last_byte(frame: bytes) -> bytes:
    return frame[:-2] + bytes([frame[-2] ^ 1]) + frame[-1:]


# client-to-server frames: 0 hello, 1 proof, 2 first command, 3 second command
TAMPER: dict[str, Mutate] = {
    "replay": lambda i, f, seen: [f, f] if i == 2 else [f],  # the first command twice
    "reorder": lambda i, f, seen: [seen["c2s"][2], f] if i == 3 else [f],  # an old command before the new
    "reflect": lambda i, f, seen: [seen["s2c"][-1]] if i == 3 else [f],  # the server's own reply, sent back
    "alter": lambda i, f, seen: [_flip_last_byte(f)] if i == 3 else [f],  # one bit of the second command
}


@pytest.mark.parametrize("attack", sorted(TAMPER))
def test_replayed_reordered_reflected_or_altered_messages_are_not_executed(
        make_service: Callable[..., Service], attack: str) -> None:
    """Finding 5: after the multiprocessing handshake, messages carried no MAC or sequence number, so
    a man in the middle could replay, reorder or alter commands. Now each such message fails its MAC,
    the connection ends (ServiceDied on the client), nothing forged runs, and the client reconnects."""
    svc = make_service()
    proxy = _Proxy(svc.server.port, c2s=TAMPER[attack])
    client = RpcClient(open_channel("127.0.0.1", proxy.port, KEY, timeout_s=5))
    assert client.call("ping", alive=_alive, n=1) == {"echo": {"op": "ping", "n": 1}}
    with pytest.raises(ServiceDied):
        client.call("ping", alive=_alive, timeout_s=10, n=12)
    client.close()
    svc.call(n=2)
    assert [c["n"] for c in svc.handled] == [1, 2]


def test_forged_reply_is_refused_by_the_client(make_service: Callable[..., Service]) -> None:
    """Finding 5: a man in the middle answering the client (its own command reflected back, or the
    server's earlier reply replayed) must not be taken for the reply: ServiceDied, not a result."""
    svc = make_service()
    # server-to-client frames: 0 hello, 1 welcome, 2 first reply, 3 second reply
    proxy = _Proxy(svc.server.port, s2c=lambda i, f, seen: [seen["c2s"][2]] if i == 2 else [f])
    client = RpcClient(open_channel("127.0.0.1", proxy.port, KEY, timeout_s=5))
    with pytest.raises(ChannelError, match="failed its MAC"):
        client.call("ping", alive=_alive, timeout_s=10, n=1)
    client.close()
    proxy = _Proxy(svc.server.port, s2c=lambda i, f, seen: [seen["s2c"][2]] if i == 3 else [f])
    client = RpcClient(open_channel("127.0.0.1", proxy.port, KEY, timeout_s=5))
    assert client.call("ping", alive=_alive, n=2) == {"echo": {"op": "ping", "n": 2}}
    with pytest.raises(ChannelError, match="failed its MAC"):
        client.call("ping", alive=_alive, timeout_s=10, n=3)
    client.close()
    svc.call(n=4)


def test_recorded_session_replayed_on_a_new_connection_is_refused(make_service: Callable[..., Service]) -> None:
    """Finding 5: everything a genuine client sent, recorded and replayed byte for byte on a new
    connection, must not authenticate (the server's nonce is fresh) and must run nothing."""
    svc = make_service()
    proxy = _Proxy(svc.server.port)
    client = RpcClient(open_channel("127.0.0.1", proxy.port, KEY, timeout_s=5))
    client.call("ping", alive=_alive, n=1)
    client.close()
    with _connect(svc.server.port) as sock:
        sock.sendall(b"".join(proxy.seen["c2s"]))
        assert _closed_by_server(sock)
    _wait_refused(svc, 1)
    svc.call(n=2)
    assert [c["n"] for c in svc.handled] == [1, 2]


class _Planted:
    """Unpickling this creates ``marker``: the proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_authenticated_pickle_is_never_unpickled(make_service: Callable[..., Service], tmp_path: Path) -> None:
    """Finding 5: after the handshake both sides unpickled whatever arrived, so any key holder (or a
    bug) could run code in rank 0. Now a correctly MAC'd pickle is refused as not JSON; it never runs."""
    svc = make_service()
    marker = tmp_path / "pickle-ran"
    with _connect(svc.server.port) as sock:
        session = _handshake(sock, KEY)
        sock.sendall(_sealed(session, b"C", 0, pickle.dumps(_Planted(marker))))
        assert _closed_by_server(sock)
    assert not marker.exists()
    with _connect(svc.server.port) as sock:  # before the handshake too
        sock.sendall(_frame(pickle.dumps(_Planted(marker))))
        assert _closed_by_server(sock)
    assert not marker.exists()
    svc.call(n=1)
    assert svc.handled == [{"op": "ping", "n": 1}]


def _fake_server(answer: Callable[[socket.socket], None]) -> tuple[socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=run, daemon=True).start()
    return listener, listener.getsockname()[1]


def _impostor(conn: socket.socket) -> None:
    hello = json.loads(_read_frame(conn))
    conn.sendall(_frame(json.dumps({"proto": PROTOCOL, "nonce": "11" * 32, "proof": "22" * 32}).encode()))
    assert hello["proto"] == PROTOCOL
    time.sleep(10)


def test_client_handshake_has_a_deadline_and_checks_the_server(tmp_path: Path) -> None:
    """Finding 5: the client handshake had no deadline (a silent server hung the flow for ever), and
    a store writer can publish any address. Now a silent server costs the connect timeout, and one
    that cannot prove the key is refused at once."""
    store = FileStore(tmp_path)
    silent, port = _fake_server(lambda conn: time.sleep(30))
    publish_address(store, "ctl.json", "127.0.0.1", port)
    t0 = time.monotonic()
    with pytest.raises(ServiceDied, match="no answer before the deadline"):
        RpcClient.connect(store, "ctl.json", KEY, 3, alive=_alive)
    assert time.monotonic() - t0 < 6
    impostor, port = _fake_server(_impostor)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="did not prove the run's control key"):
        open_channel("127.0.0.1", port, KEY, timeout_s=5)
    assert time.monotonic() - t0 < 2
    silent.close()
    impostor.close()


def test_many_bad_peers_then_the_real_client(make_service: Callable[..., Service]) -> None:
    """Finding 5: rank 0 accepted exactly once. Now it serves the real client after any number of bad
    peers, with silent ones still connected, and again after the client reconnects."""
    svc = make_service(handshake_timeout_s=3.0)
    kinds = sorted(BAD_PEERS)
    silent = [_connect(svc.server.port) for _ in range(4)]
    for i in range(60):
        with _connect(svc.server.port) as sock:
            if i % 3 == 0:
                with pytest.raises(EOFError):
                    _handshake(sock, WRONG)
            else:
                BAD_PEERS[kinds[i % len(kinds)]](sock)
    _wait_refused(svc, 60)
    svc.call(n=1)
    svc.call(n=2)  # a reconnect
    assert [c["n"] for c in svc.handled] == [1, 2]
    for s in silent:
        s.close()


def test_handshakes_in_progress_are_capped(make_service: Callable[..., Service]) -> None:
    """Finding 5: a flood of silent connections must not hold unbounded threads; beyond the cap they
    are closed at once, and the real client gets in as soon as a slot frees."""
    svc = make_service(handshake_timeout_s=1.0, max_pending=4)
    silent = [_connect(svc.server.port) for _ in range(10)]
    _wait_refused(svc, 6, within_s=0.9)  # the six beyond the cap, closed before any deadline
    svc.call(n=1)
    assert svc.handled == [{"op": "ping", "n": 1}]
    assert all(_closed_by_server(s) for s in silent)
    for s in silent:
        s.close()
