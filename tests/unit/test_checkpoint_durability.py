"""Checkpoint saving under a faulty store: a new checkpoint becomes current only once it verifies.

Replays the durability fault of issue #16 for trainer checkpoints: an object of the new checkpoint
left half-written in the store (the store took the write, the bytes did not all land). One-rank gloo
process group in this process (the ``group`` fixture); a real file store under ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.checkpoint_helpers import set_run_secret, tiny_engine  # noqa: E402

from infra.storage import FileStore, get_json, run_key  # noqa: E402


class TornWrites(FileStore):
    """A file store that writes only the first half of the objects whose key contains ``torn``, as a
    store that acknowledged a write whose tail was lost would leave them."""

    def __init__(self, root: Path, torn: str) -> None:
        super().__init__(root)
        self.torn = torn

    def put(self, key: str, data: bytes) -> None:
        """Store ``data``, cut in half when ``key`` matches."""
        super().put(key, data[: len(data) // 2] if self.torn and self.torn in key else data)


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run secret in the environment, as the trainer ranks receive it (checkpoints are signed)."""
    set_run_secret(monkeypatch)


def test_half_written_checkpoint_never_becomes_current(group: None, tmp_path: Path) -> None:
    """Replays issue #16's checkpoint fault: the newest checkpoint's engine file is half-written.
    ``save`` reads the manifest back and checks every object before it moves ``latest.json`` or
    deletes anything, so it fails naming the object, un-commits the bad step, and the previous
    checkpoint stays current and restorable. On the code before, ``save`` succeeded, pointed
    ``latest.json`` at the broken step and deleted the only good one (keep=1)."""
    from infra.train import checkpoint

    store = TornWrites(tmp_path / "store", torn="")
    a = tiny_engine(0)
    checkpoint.save(store, "r", 1, a, {"weights_version": 1}, rank=0, world=1, keep=1)
    want = {k: v.clone() for k, v in a.module.state_dict().items()}
    assert get_json(store, run_key("r", None, "checkpoints", "latest.json")) == {"step": 1}

    store.torn = f"{checkpoint.ckpt_dir('r', 2)}/files/"
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(store, "r", 2, tiny_engine(7), {"weights_version": 2}, rank=0, world=1, keep=1)
    assert "step 2" in str(err.value) and store.torn in str(err.value) and "bytes" in str(err.value)
    assert checkpoint.committed_steps(store, "r") == [1]
    assert get_json(store, run_key("r", None, "checkpoints", "latest.json")) == {"step": 1}

    b = tiny_engine(123)
    man = checkpoint.restore(store, "r", 1, b, rank=0, world=1)
    assert man["step"] == 1
    for k, v in b.module.state_dict().items():
        assert torch.equal(v, want[k]), k

    store.torn = ""  # the store recovers: the next save commits, and only then is step 1 collected
    checkpoint.save(store, "r", 2, tiny_engine(7), {"weights_version": 2}, rank=0, world=1, keep=1)
    assert checkpoint.committed_steps(store, "r") == [2]
    assert get_json(store, run_key("r", None, "checkpoints", "latest.json")) == {"step": 2}
