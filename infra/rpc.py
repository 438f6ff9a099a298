"""A small authenticated request/reply channel between the flow and a long-lived service.

The trainer's rank 0 serves commands (``{"op": ..., ...}`` dicts) to one *controller* (the flow's
:class:`RpcClient`). The listening address is *published to the object store* under the run, which
makes discovery identical for a local process group and ranks on other hosts (they share the store,
not a filesystem). The rollout worker reports its HTTP port the same way (:func:`publish_address`,
:func:`address_probe`): every service binds its own port and says which one it got.

Wire format (TCP, nothing is ever unpickled). Every message is a 4-byte big-endian length and a body;
the length is checked against a limit before any buffer is allocated (:data:`MAX_HANDSHAKE` before
the peer has proven the key, :data:`MAX_MESSAGE` after).

- Handshake, mutual challenge-response, JSON bodies, :data:`HANDSHAKE_TIMEOUT_S` deadline on both
  sides: the client sends its nonce; the server answers with its nonce and a proof
  ``HMAC(key, "server" | nc | ns)``; the client checks it and answers ``HMAC(key, "client" | nc |
  ns)``; the server checks that and sends a first authenticated ``{"ok": true}``. The two labels
  make a proof useless in the other direction, and both nonces make it useless on another
  connection. Each connection then uses its own session key ``HMAC(key, "session" | nc | ns)``.
- Messages: ``MAC(32 bytes) | JSON``, the MAC being HMAC-SHA256 under the session key of the
  direction byte, a 64-bit sequence number that each side counts (never sent) and the JSON. A
  replayed, reordered, reflected or altered message fails its MAC and ends the connection. Messages
  are authenticated, not encrypted: commands and replies carry store keys and metrics, no secrets.

The key is :func:`control_key`: ``derive_key(run_secret(), "rpc")`` (:mod:`infra.secrets`), not a
second random key handed to the ranks. One run secret is the one thing a process needs to prove it
belongs to the run (ranks on other hosts already receive it in their environment); deriving the
channel's key from it keeps the purposes apart (the checkpoint MAC key is another derivation), and a
resumed flow, which finds the same ``run.key``, can drive a group it did not start.

Rank 0's :class:`RpcServer` runs each handshake on its own short-lived thread, so a silent peer, a
wrong key, garbage or a reset costs one log line and never blocks the next connection; at most
:data:`MAX_PENDING` handshakes run at once. One authenticated controller is served at a time; when
its connection ends, the next authenticated one (a reconnect) takes over, and if none arrives within
the service's wait the server asks the service to shut down (a dead-man switch where no lifeline
watches the flow, as on Kubernetes).

Replies are dicts; a reply with ``"error"`` re-raises on the client as :class:`RemoteError` (its
``retryable`` is the remote exception's); a lost or broken connection raises :class:`ChannelError`,
a :class:`~infra.proc.ServiceDied`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import secrets
import select
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

from infra.errors import DeltaloopError
from infra.proc import ServiceDied, wait_until
from infra.secrets import derive_key, run_secret
from infra.storage import ObjectNotFound, ObjectStore, get_json, put_json

log = logging.getLogger(__name__)

PROTOCOL = "deltaloop-rpc/1"
MAX_MESSAGE = 64 << 20  # bytes of one authenticated message (MAC + JSON)
MAX_HANDSHAKE = 1024  # bytes of one handshake message: what a peer gets before it proves the key
HANDSHAKE_TIMEOUT_S = 10.0  # the whole handshake, on both sides
MAX_PENDING = 32  # handshakes in progress at once on a server; more connections are closed at once
REPLY_TIMEOUT_S = 120.0  # the server's deadline to hand a reply to a controller that stopped reading
_HEADER = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_MAC_LEN = 32
_NONCE_LEN = 32
_TO_SERVER, _TO_CLIENT = b"C", b"S"


class RemoteError(DeltaloopError):
    """A command failed inside the service. ``retryable`` mirrors the remote exception's flag."""

    def __init__(self, op: str, message: str, tb: str, retryable: bool) -> None:
        super().__init__(f"{op} failed in service: {message}\n--- remote traceback ---\n{tb}")
        self.op = op
        self.retryable = retryable


class ChannelError(ServiceDied):
    """The control connection is unusable: the peer closed it, did not answer in time, or broke the
    protocol (size limit, handshake, MAC). Retryable, like any lost connection."""

    retryable = True


class ChannelClosed(ChannelError):
    """The peer closed the connection (at a message boundary or inside one)."""

    retryable = True


def control_key(run_dir: str | Path | None = None) -> bytes:
    """The control channel's key: ``derive_key(run_secret(run_dir), "rpc")`` (see the module doc)."""
    return derive_key(run_secret(run_dir), "rpc")


def host_address() -> str:
    """Address other hosts can use to reach this one (loopback when alone)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def publish_address(store: ObjectStore, key: str, host: str, port: int) -> None:
    """Report where a service listens: ``{"host", "port", "ts"}`` at ``key`` in the store."""
    put_json(store, key, {"host": host, "port": int(port), "ts": time.time()})


def address_probe(store: ObjectStore, key: str, not_before: float = 0.0) -> Callable[[], dict | None]:
    """A readiness probe (:func:`infra.proc.wait_until`) returning the address published at ``key``
    once one newer than ``not_before`` is there."""

    def probe() -> dict | None:
        try:
            addr = get_json(store, key)
        except ObjectNotFound:
            return None
        return addr if addr.get("ts", 0) >= not_before else None

    return probe


# ------------------------------------------------------------------------------------ framing
def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise ChannelError("no answer before the deadline")
    return left


def _settimeout(sock: socket.socket, deadline: float | None) -> None:
    left = _left(deadline)
    if left is not None or sock.gettimeout() is not None:  # a blocking socket stays so (no syscall)
        sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    """Exactly ``n`` bytes (the caller has checked ``n`` against its limit)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    try:
        while got < n:
            _settimeout(sock, deadline)
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ChannelClosed("connection closed by the peer")
            got += k
    except TimeoutError:
        raise ChannelError("no answer before the deadline") from None
    except OSError as exc:
        raise ChannelClosed(f"connection lost ({exc})") from None
    return buf


def _send_frame(sock: socket.socket, parts: list[bytes], deadline: float | None) -> None:
    data = b"".join([_HEADER.pack(sum(len(p) for p in parts)), *parts])
    try:
        _settimeout(sock, deadline)
        sock.sendall(data)
    except TimeoutError:
        raise ChannelError("the peer does not read (send deadline passed)") from None
    except OSError as exc:
        raise ChannelClosed(f"connection lost ({exc})") from None


def _recv_frame(sock: socket.socket, limit: int, deadline: float | None, what: str) -> bytearray:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if n > limit:
        raise ChannelError(f"{what} of {n} bytes refused (limit {limit})")
    return _recv_exact(sock, n, deadline)


def _decode(body: bytes | bytearray | memoryview, what: str) -> Any:
    try:
        return json.loads(bytes(body))
    except (ValueError, RecursionError) as exc:
        raise ChannelError(f"{what} is not JSON ({type(exc).__name__})") from None


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _nodelay(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


class Channel:
    """One authenticated connection: framed, MAC'd JSON messages, sequence-numbered per direction."""

    def __init__(self, sock: socket.socket, session_key: bytes, outgoing: bytes, peer: str) -> None:
        self._sock = sock
        self._key = session_key
        self._out = outgoing
        self._in = _TO_SERVER if outgoing == _TO_CLIENT else _TO_CLIENT
        self._sent = 0
        self._received = 0
        self.peer = peer

    def _tag(self, direction: bytes, seq: int, body: bytes | memoryview) -> bytes:
        head = direction + _SEQ.pack(seq)
        if len(body) < 1 << 16:  # one-shot HMAC in C: the common, small message
            return hmac.digest(self._key, head + bytes(body), "sha256")
        h = hmac.new(self._key, head, hashlib.sha256)
        h.update(body)  # a large message is not copied
        return h.digest()

    def send(self, obj: Any, timeout_s: float | None = None) -> None:
        """Send one JSON value. ``TypeError``/``ValueError`` (nothing sent) if it is not JSON."""
        body = json.dumps(obj, separators=(",", ":")).encode()
        if len(body) + _MAC_LEN > MAX_MESSAGE:
            raise ChannelError(f"message of {len(body) + _MAC_LEN} bytes refused (limit {MAX_MESSAGE})")
        _send_frame(self._sock, [self._tag(self._out, self._sent, body), body], _deadline(timeout_s))
        self._sent += 1

    def recv(self, timeout_s: float | None = None) -> Any:
        """Receive the next JSON value; :class:`ChannelError` if it is not the peer's next message."""
        frame = _recv_frame(self._sock, MAX_MESSAGE, _deadline(timeout_s), f"message from {self.peer}")
        if len(frame) < _MAC_LEN:
            raise ChannelError(f"message from {self.peer} is shorter than its MAC")
        view = memoryview(frame)
        if not hmac.compare_digest(self._tag(self._in, self._received, view[_MAC_LEN:]), bytes(view[:_MAC_LEN])):
            raise ChannelError(f"message {self._received} from {self.peer} failed its MAC "
                               "(altered, replayed, reordered or reflected)")
        self._received += 1
        return _decode(view[_MAC_LEN:], f"message from {self.peer}")

    def readable(self, timeout_s: float) -> bool:
        """Whether data (or EOF) is waiting, after at most ``timeout_s`` seconds."""
        poller = select.poll()
        poller.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(max(0, int(timeout_s * 1000))))

    def close(self) -> None:
        """Close the connection."""
        try:
            self._sock.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------------- handshake
def _proof(key: bytes, label: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(key, PROTOCOL.encode() + b"|" + label + b"|" + nc + ns, hashlib.sha256).digest()


def _hs_send(sock: socket.socket, msg: dict[str, str], deadline: float) -> None:
    _send_frame(sock, [json.dumps(msg).encode()], deadline)


def _hs_recv(sock: socket.socket, deadline: float, peer: str) -> dict:
    msg = _decode(_recv_frame(sock, MAX_HANDSHAKE, deadline, f"handshake message from {peer}"),
                  f"handshake message from {peer}")
    if not isinstance(msg, dict):
        raise ChannelError(f"handshake message from {peer} is not an object")
    return msg


def _hex_field(msg: dict, name: str, size: int, peer: str) -> bytes:
    value = msg.get(name)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ChannelError(f"handshake from {peer}: field {name!r} is not {size} hex bytes")
    return raw


def server_handshake(sock: socket.socket, key: bytes, peer: str,
                     timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """Authenticate a connected client (it must prove ``key``, and is shown that we hold it)."""
    deadline = time.monotonic() + timeout_s
    hello = _hs_recv(sock, deadline, peer)
    if hello.get("proto") != PROTOCOL:
        raise ChannelError(f"handshake from {peer}: not {PROTOCOL}")
    nc = _hex_field(hello, "nonce", _NONCE_LEN, peer)
    ns = secrets.token_bytes(_NONCE_LEN)
    _hs_send(sock, {"proto": PROTOCOL, "nonce": ns.hex(), "proof": _proof(key, b"server", nc, ns).hex()}, deadline)
    answer = _hs_recv(sock, deadline, peer)
    if not hmac.compare_digest(_hex_field(answer, "proof", _MAC_LEN, peer), _proof(key, b"client", nc, ns)):
        raise ChannelError(f"handshake from {peer}: wrong key (the client's proof does not match)")
    channel = Channel(sock, _proof(key, b"session", nc, ns), _TO_CLIENT, peer)
    channel.send({"ok": True}, timeout_s=_left(deadline))
    return channel


def client_handshake(sock: socket.socket, key: bytes, peer: str,
                     timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """Authenticate to a server (it must prove ``key`` first, then we do)."""
    deadline = time.monotonic() + timeout_s
    nc = secrets.token_bytes(_NONCE_LEN)
    _hs_send(sock, {"proto": PROTOCOL, "nonce": nc.hex()}, deadline)
    reply = _hs_recv(sock, deadline, peer)
    ns = _hex_field(reply, "nonce", _NONCE_LEN, peer)
    if reply.get("proto") != PROTOCOL or not hmac.compare_digest(
            _hex_field(reply, "proof", _MAC_LEN, peer), _proof(key, b"server", nc, ns)):
        raise ChannelError(f"{peer} did not prove the run's control key (not this run's service)")
    _hs_send(sock, {"proof": _proof(key, b"client", nc, ns).hex()}, deadline)
    channel = Channel(sock, _proof(key, b"session", nc, ns), _TO_SERVER, peer)
    try:
        welcome = channel.recv(timeout_s=_left(deadline))
    except ChannelClosed:
        raise ChannelError(f"{peer} refused our key (closed the connection after our proof)") from None
    if welcome != {"ok": True}:
        raise ChannelError(f"{peer} did not accept the handshake")
    return channel


# ------------------------------------------------------------------------------------- server
class RpcServer:
    """Rank 0's side: a listening socket, handshakes on their own threads, one controller served.

    :meth:`next_command` blocks until the controller sends a command, taking the next authenticated
    connection whenever the current one ends; :meth:`reply` answers it. Failed handshakes are logged
    and counted in :attr:`refused`; they never reach the caller.
    """

    def __init__(self, key: bytes, bind: str = "127.0.0.1", handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_pending: int = MAX_PENDING) -> None:
        self._key = key
        self._handshake_timeout_s = handshake_timeout_s
        self._sock = socket.create_server((bind, 0), backlog=64)
        self._sock.settimeout(0.5)  # the accept loop checks for close() this often
        self.port: int = self._sock.getsockname()[1]
        self._ready: queue.Queue[Channel | None] = queue.Queue()  # None: closed
        self._max_pending = max_pending
        self._slots = threading.BoundedSemaphore(max_pending)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._current: Channel | None = None
        self.refused = 0  # failed or dropped handshakes so far
        self.controllers = 0  # authenticated connections served so far
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="rpc-accept")
        self._thread.start()

    def _refuse(self, peer: str, why: object) -> None:
        with self._lock:
            self.refused += 1
        log.warning("rpc: refused %s: %s", peer, why)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._closed.is_set():
                    return
                log.warning("rpc: accept failed: %s", exc)  # e.g. out of file descriptors: try again
                time.sleep(0.1)
                continue
            peer = f"{addr[0]}:{addr[1]}"
            if not self._slots.acquire(blocking=False):
                conn.close()
                self._refuse(peer, f"{self._max_pending} handshakes already in progress")
                continue
            try:
                threading.Thread(target=self._handshake, args=(conn, peer), daemon=True, name="rpc-handshake").start()
            except RuntimeError as exc:  # no thread to spare: refuse this one, keep listening
                self._slots.release()
                conn.close()
                self._refuse(peer, exc)

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        try:
            _nodelay(conn)
            channel = server_handshake(conn, self._key, peer, self._handshake_timeout_s)
        except ChannelError as exc:
            conn.close()
            self._refuse(peer, exc)
        except Exception as exc:  # whatever a peer sends, it must never take the listener down
            conn.close()
            self._refuse(peer, f"{type(exc).__name__}: {exc}")
        else:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            except OSError:
                pass
            self._ready.put(channel)
        finally:
            self._slots.release()

    def _take_current(self) -> Channel | None:
        """The current controller's channel, no longer current (:meth:`close` may take it from
        another thread while the serving thread drops it)."""
        with self._lock:
            current, self._current = self._current, None
        return current

    def _drop(self, why: object) -> None:
        current = self._take_current()
        if current is not None:
            log.warning("rpc: controller %s gone: %s", current.peer, why)
            current.close()

    def next_command(self, wait_s: float | None = None) -> dict[str, Any]:
        """The controller's next command; ``{"op": "shutdown"}`` when no controller is connected
        and none authenticates within ``wait_s`` seconds (None: wait for ever), or once the server
        is closed (:meth:`close`)."""
        while True:
            current = self._current
            if current is None:
                try:
                    current = self._ready.get(timeout=wait_s)
                except queue.Empty:
                    log.warning("rpc: no controller connected within %.0fs: shutting down", wait_s or 0)
                    return {"op": "shutdown"}
                if current is None:  # closed: this and every later call
                    self._ready.put(None)
                    return {"op": "shutdown"}
                self._current = current
                self.controllers += 1
                if self._closed.is_set():  # closed while it was handed over (else close() closes it)
                    self._drop("the server is closed")
                    continue
            try:
                cmd = current.recv()
            except ChannelError as exc:
                self._drop(exc)
                continue
            if isinstance(cmd, dict) and isinstance(cmd.get("op"), str):
                return cmd
            self.reply({"error": "ProtocolError: a command is an object with a string 'op'", "traceback": "",
                        "retryable": False})

    def reply(self, obj: dict[str, Any]) -> None:
        """Answer the current command (dropped, with a log line, if the controller has gone)."""
        current = self._current
        if current is None:
            log.warning("rpc: reply dropped: no controller connected")
            return
        try:
            try:
                current.send(obj, timeout_s=REPLY_TIMEOUT_S)
            except (TypeError, ValueError) as exc:  # a reply that is not JSON: report it, keep serving
                current.send({"error": f"reply is not JSON: {exc}", "traceback": "", "retryable": False},
                             timeout_s=REPLY_TIMEOUT_S)
        except ChannelError as exc:
            self._drop(exc)

    def close(self) -> None:
        """Stop accepting and close every connection (pending handshakes end at their deadline).

        A :meth:`next_command` waiting in another thread, or called later, returns
        ``{"op": "shutdown"}``, so the thread serving commands ends instead of waiting for ever."""
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop now (Linux)
        except OSError:
            pass
        self._sock.close()
        current = self._take_current()
        if current is not None:
            current.close()
        while not self._ready.empty():
            channel = self._ready.get_nowait()
            if channel is not None:
                channel.close()
        self._ready.put(None)
        self._thread.join(2)


def serve_listener(store: ObjectStore, key: str, authkey: bytes, bind: str = "0.0.0.0") -> RpcServer:
    """Open a :class:`RpcServer` on a free port (bound here: no race) and publish its address at ``key``."""
    server = RpcServer(authkey, bind)
    host = "127.0.0.1" if bind in ("127.0.0.1", "localhost") else host_address()
    publish_address(store, key, host, server.port)
    return server


# ------------------------------------------------------------------------------------- client
def open_channel(host: str, port: int, key: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Channel:
    """Connect and run the client handshake, all within ``timeout_s``."""
    peer = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise ChannelError(f"cannot connect to {peer} ({exc})") from None
    _nodelay(sock)
    try:
        return client_handshake(sock, key, peer, timeout_s)
    except BaseException:
        sock.close()
        raise


class RpcClient:
    """Client side: connect to the published address and send commands one at a time."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    @classmethod
    def connect(
        cls,
        store: ObjectStore,
        key: str,
        authkey: bytes,
        timeout_s: float,
        alive: Callable[[], str | None],
        not_before: float = 0.0,
    ) -> "RpcClient":
        """Wait for the address at ``key`` (newer than ``not_before``) and connect.

        A failed connection or handshake is tried again until ``timeout_s``. ``alive()`` returns None
        while the service is starting, or a description of why it died; then :class:`ServiceDied`
        is raised at once instead of waiting out the timeout.
        """
        last_err: list[Exception] = []
        deadline = time.monotonic() + timeout_s

        def probe() -> "RpcClient | None":
            addr = address_probe(store, key, not_before)()
            if addr is None:
                return None
            try:
                left = min(HANDSHAKE_TIMEOUT_S, max(1.0, deadline - time.monotonic()))
                return cls(open_channel(str(addr["host"]), int(addr["port"]), authkey, left))
            except (ChannelError, KeyError, TypeError, ValueError) as exc:
                last_err[:] = [exc]
                return None

        try:
            return wait_until(probe, timeout_s, alive, "service")
        except ServiceDied as exc:
            if alive():
                raise
            raise ServiceDied(f"{exc} ({last_err[0] if last_err else 'no address published'})") from None

    def call(self, op: str, alive: Callable[[], str | None], timeout_s: float = 3600.0, **kwargs: Any) -> dict:
        """Send one command and wait for its reply, watching that the service stays alive.

        The command must be JSON (``TypeError`` otherwise, nothing sent)."""
        deadline = time.monotonic() + timeout_s
        try:
            self._channel.send({"op": op, **kwargs}, timeout_s=timeout_s)
            while not self._channel.readable(0.5):
                dead = alive()
                if dead:
                    raise ServiceDied(f"{op}: {dead}")
                if time.monotonic() > deadline:
                    raise ServiceDied(f"{op}: no reply within {timeout_s:.0f}s")
            reply = self._channel.recv(timeout_s=max(1.0, deadline - time.monotonic()))
        except ChannelError as exc:
            raise ChannelError(f"{op}: {exc}; {alive() or 'service still running'}") from exc
        if isinstance(reply, dict) and "error" in reply:
            raise RemoteError(op, str(reply["error"]), str(reply.get("traceback", "")), bool(reply.get("retryable")))
        if not isinstance(reply, dict):
            raise ChannelError(f"{op}: the reply is not an object")
        return reply

    def close(self) -> None:
        """Close the connection (the service keeps running and accepts a new controller)."""
        self._channel.close()
