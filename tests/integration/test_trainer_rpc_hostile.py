"""Finding 5 of issue #15 against a real trainer: hostile peers on rank 0's control port.

A real :class:`infra.train.service.TrainerService` (torchrun, 2 gloo ranks, tiny model) is driven
while strangers connect to the address rank 0 published in the store: a peer with the wrong key, one
sending garbage, an oversized length prefix, and silent peers that stay connected. The flow's client
must keep being served, also after it drops its connection and reconnects (on the code before this
change, rank 0 shut the group down when its one connection ended, and any of these peers arriving
while it accepted killed or blocked it).
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.intermediate_size=128",
        "model.tiny.num_heads=2", "warmstart.steps=0"]


def _attack(host: str, port: int) -> list[socket.socket]:
    """Wrong key, garbage, a 4 GiB length prefix; returns the silent peers, still connected."""
    from infra.rpc import ChannelError, open_channel

    with pytest.raises(ChannelError, match="did not prove"):
        open_channel(host, port, b"w" * 32, timeout_s=10)
    for payload in (b"\x80\x03garbage" * 100, struct.pack(">I", 0xFFFFFFFF)):
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(payload)
    return [socket.create_connection((host, port), timeout=5) for _ in range(3)]


def test_trainer_keeps_serving_through_bad_peers_and_a_reconnect(tmp_path: Path) -> None:
    """Finding 5: wrong-key, garbage, oversized and silent peers leave the trainer serving its flow."""
    from infra.config import load_config
    from infra.storage import get_json, open_store
    from infra.train.service import TrainerService

    cfg = load_config("configs/demo.yaml", [*TINY, f"run_root={tmp_path}"])
    store = open_store(cfg.resolved_storage_root())
    with TrainerService(cfg, "rpc-hostile", store, tmp_path / "rpc-hostile") as svc:
        addr = get_json(store, svc.control_key)
        assert svc.call("ping", timeout_s=60)["ranks"] == 2
        silent = _attack(addr["host"], addr["port"])  # while the flow is connected
        assert svc.call("ping", timeout_s=60)["ranks"] == 2
        assert svc._client is not None
        svc._client.close()  # the flow's connection ends: rank 0 waits for a controller...
        silent += _attack(addr["host"], addr["port"])  # ...and strangers arrive first
        svc.reconnect()
        assert svc.call("ping", timeout_s=60)["ranks"] == 2
        svc.reconnect()
        assert svc.call("ping", timeout_s=60)["ranks"] == 2
        assert svc.dead_reason() is None
        for sock in silent:
            sock.close()
