"""A tiny authenticated request/reply channel between the flow and a long-lived service.

The trainer's rank 0 serves commands (``{"op": ..., ...}`` dicts) over a
``multiprocessing.connection`` socket authenticated with a random key (HMAC challenge, so a
stranger on the network cannot drive the trainer). The listening address is *published to the
object store* under the run, which makes discovery identical for a local process group and ranks on
other hosts (they share the store, not a filesystem). The rollout worker reports its HTTP port the
same way (:func:`publish_address`, :func:`address_probe`): every service binds its own port and
says which one it got.

Replies are dicts; a reply with ``"error"`` re-raises on the client as :class:`RemoteError`.
"""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable

from infra.errors import DeltaloopError
from infra.proc import ServiceDied, wait_until
from infra.storage import ObjectNotFound, ObjectStore, get_json, put_json


class RemoteError(DeltaloopError):
    """A command failed inside the service. ``retryable`` mirrors the remote exception's flag."""

    def __init__(self, op: str, message: str, tb: str, retryable: bool) -> None:
        super().__init__(f"{op} failed in service: {message}\n--- remote traceback ---\n{tb}")
        self.op = op
        self.retryable = retryable


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


def serve_listener(store: ObjectStore, key: str, authkey: bytes, bind: str = "0.0.0.0") -> Listener:
    """Open a listener on a free port (bound here: no race) and publish its address at ``key``."""
    listener = Listener((bind, 0), authkey=authkey)
    host = "127.0.0.1" if bind in ("127.0.0.1", "localhost") else host_address()
    publish_address(store, key, host, listener.address[1])
    return listener


class RpcClient:
    """Client side: connect to the published address and send commands one at a time."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

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

        ``alive()`` returns None while the service is starting, or a description of why it died;
        then :class:`ServiceDied` is raised at once instead of waiting out the timeout.
        """
        last_err: list[Exception] = []

        def probe() -> "RpcClient | None":
            addr = address_probe(store, key, not_before)()
            if addr is None:
                return None
            try:
                return cls(Client((addr["host"], int(addr["port"])), authkey=authkey))
            except (OSError, EOFError) as exc:
                last_err[:] = [exc]
                return None

        try:
            return wait_until(probe, timeout_s, alive, "service")
        except ServiceDied as exc:
            if alive():
                raise
            raise ServiceDied(f"{exc} ({last_err[0] if last_err else 'no address published'})") from None

    def call(self, op: str, alive: Callable[[], str | None], timeout_s: float = 3600.0, **kwargs: Any) -> dict:
        """Send one command and wait for its reply, watching that the service stays alive."""
        try:
            self._conn.send({"op": op, **kwargs})
            deadline = time.monotonic() + timeout_s
            while not self._conn.poll(0.5):
                dead = alive()
                if dead:
                    raise ServiceDied(f"{op}: {dead}")
                if time.monotonic() > deadline:
                    raise ServiceDied(f"{op}: no reply within {timeout_s:.0f}s")
            reply = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise ServiceDied(f"{op}: connection lost ({exc}); {alive() or 'service still running'}") from exc
        if isinstance(reply, dict) and "error" in reply:
            raise RemoteError(op, reply["error"], reply.get("traceback", ""), bool(reply.get("retryable")))
        return reply

    def close(self) -> None:
        """Close the connection (the service keeps running)."""
        try:
            self._conn.close()
        except OSError:
            pass
