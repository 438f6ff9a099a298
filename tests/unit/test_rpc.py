"""The trainer's control channel: address discovery through the store, HMAC auth, typed errors."""

from __future__ import annotations

import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from infra.rpc import RemoteError, RpcClient, ServiceDied, serve_listener
from infra.storage import FileStore, get_json


def _serve(store: FileStore, key: str, authkey: bytes) -> threading.Thread:
    listener = serve_listener(store, key, authkey, bind="127.0.0.1")

    def run() -> None:
        conn = listener.accept()
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                break
            if cmd["op"] == "boom":
                conn.send({"error": "ValueError: bad", "traceback": "tb", "retryable": False})
            else:
                conn.send({"echo": cmd})
        listener.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_call_and_remote_error(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    _serve(store, "ctl.json", b"k" * 32)
    client = RpcClient.connect(store, "ctl.json", b"k" * 32, 10, alive=lambda: None)
    assert client.call("ping", alive=lambda: None, x=1) == {"echo": {"op": "ping", "x": 1}}
    with pytest.raises(RemoteError) as info:
        client.call("boom", alive=lambda: None)
    assert info.value.op == "boom" and not info.value.retryable
    client.close()


def test_wrong_key_is_refused(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    listener = serve_listener(store, "ctl.json", b"right" * 8, bind="127.0.0.1")
    addr = get_json(store, "ctl.json")
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            listener.accept()
        except BaseException as exc:  # the server side sees the failed handshake too
            errors.append(exc)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        Client((addr["host"], addr["port"]), authkey=b"wrong" * 8)
    t.join(5)
    listener.close()
    assert errors and isinstance(errors[0], (AuthenticationError, EOFError, ConnectionError))


def test_dead_service_fails_fast(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    with pytest.raises(ServiceDied, match="exited with code 1"):
        RpcClient.connect(store, "never.json", b"k", 30, alive=lambda: "exited with code 1")
