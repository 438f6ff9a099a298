"""The trainer's control channel: address discovery through the store, the authenticated JSON channel,
typed errors, reconnects. Every test runs a real :class:`RpcServer` on loopback in a thread, served
the way rank 0 serves it (``next_command`` / ``reply``)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from infra.rpc import ChannelError, RemoteError, RpcClient, RpcServer, ServiceDied, control_key, serve_listener
from infra.secrets import SECRET_ENV, derive_key, run_secret
from infra.storage import FileStore, get_json

KEY = b"k" * 32


def _alive() -> None:
    return None


def serve(server: RpcServer, handled: list[dict[str, Any]], wait_s: float | None = None) -> threading.Thread:
    """Rank 0's loop in a thread: echo each command, ``boom`` fails, ``nan`` and ``blob`` test replies."""

    def run() -> None:
        while True:
            cmd = server.next_command(wait_s)
            handled.append(cmd)
            if cmd["op"] == "shutdown":
                server.reply({"ok": True})
                break
            if cmd["op"] == "boom":
                server.reply({"error": "ValueError: bad", "traceback": "tb", "retryable": False})
            elif cmd["op"] == "nan":
                server.reply({"loss": math.nan, "norm": math.inf})
            elif cmd["op"] == "blob":
                server.reply({"obj": object()})  # not JSON: the client gets an error reply
            else:
                server.reply({"echo": cmd})
        server.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_call_and_remote_error(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    serve(serve_listener(store, "ctl.json", KEY, bind="127.0.0.1"), [])
    client = RpcClient.connect(store, "ctl.json", KEY, 10, alive=_alive)
    assert client.call("ping", alive=_alive, x=1, key="runs/r/step-000001/x.json") == {
        "echo": {"op": "ping", "x": 1, "key": "runs/r/step-000001/x.json"}}
    with pytest.raises(RemoteError) as info:
        client.call("boom", alive=_alive)
    assert info.value.op == "boom" and not info.value.retryable
    reply = client.call("nan", alive=_alive)
    assert math.isnan(reply["loss"]) and reply["norm"] == math.inf
    with pytest.raises(RemoteError, match="reply is not JSON"):
        client.call("blob", alive=_alive)
    assert client.call("ping", alive=_alive) == {"echo": {"op": "ping"}}  # still in step after the errors
    with pytest.raises(TypeError):  # a command that is not JSON is refused before anything is sent
        client.call("ping", alive=_alive, path=Path("/x"))
    assert client.call("shutdown", alive=_alive) == {"ok": True}
    client.close()


def test_reconnect_after_close(tmp_path: Path) -> None:
    """A controller that closes its connection is replaced by the next one; the server keeps its state."""
    store = FileStore(tmp_path)
    handled: list[dict[str, Any]] = []
    server = serve_listener(store, "ctl.json", KEY, bind="127.0.0.1")
    thread = serve(server, handled)
    for i in range(3):
        client = RpcClient.connect(store, "ctl.json", KEY, 10, alive=_alive)
        assert client.call("ping", alive=_alive, i=i) == {"echo": {"op": "ping", "i": i}}
        client.close()
    assert [c.get("i") for c in handled] == [0, 1, 2] and server.controllers == 3
    server.close()  # the serving thread gets a shutdown and ends (it would wait for ever otherwise)
    thread.join(10)
    assert not thread.is_alive() and handled[-1] == {"op": "shutdown"}


def test_close_hands_a_waiting_server_loop_shutdown(tmp_path: Path) -> None:
    """Closing the server from another thread ends a ``next_command`` that waits for ever, now and
    on every later call."""
    server = serve_listener(FileStore(tmp_path), "ctl.json", KEY, bind="127.0.0.1")
    got: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: got.append(server.next_command(None)), daemon=True)
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # no controller: it waits
    server.close()
    waiter.join(10)
    assert not waiter.is_alive() and got == [{"op": "shutdown"}]
    assert server.next_command(None) == {"op": "shutdown"}


def test_no_controller_means_shutdown(tmp_path: Path) -> None:
    """With no controller for ``wait_s``, the server hands rank 0 a shutdown (the dead-man switch)."""
    handled: list[dict[str, Any]] = []
    server = serve_listener(FileStore(tmp_path), "ctl.json", KEY, bind="127.0.0.1")
    t0 = time.monotonic()
    serve(server, handled, wait_s=0.5).join(10)
    assert handled == [{"op": "shutdown"}] and time.monotonic() - t0 < 5


def test_lost_connection_is_service_died(tmp_path: Path) -> None:
    """A server that goes away mid-call surfaces as ServiceDied (retryable), with the service's state."""
    store = FileStore(tmp_path)
    server = serve_listener(store, "ctl.json", KEY, bind="127.0.0.1")

    def one_then_close() -> None:
        server.next_command(None)
        server.close()

    threading.Thread(target=one_then_close, daemon=True).start()
    client = RpcClient.connect(store, "ctl.json", KEY, 10, alive=_alive)
    with pytest.raises(ServiceDied, match="still running") as info:
        client.call("ping", alive=_alive, timeout_s=10)
    assert isinstance(info.value, ChannelError) and info.value.retryable


def test_published_address(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    server = serve_listener(store, "ctl.json", KEY, bind="127.0.0.1")
    addr = get_json(store, "ctl.json")
    assert addr["host"] == "127.0.0.1" and addr["port"] == server.port
    server.close()


def test_control_key_is_the_run_secret_derivation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    key = control_key(tmp_path)
    assert key == derive_key(run_secret(tmp_path), "rpc") and key != derive_key(run_secret(tmp_path), "checkpoint")


def test_dead_service_fails_fast(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(ServiceDied, match="exited with code 1"):
        RpcClient.connect(store, "never.json", b"k", 30, alive=lambda: "exited with code 1")
