"""Trainer checkpoints run no code from the store: finding 1 of issue #15 ("code execution from the store").

The attacker here can write the run's object store (a shared bucket, a mounted folder) but does not
hold the run secret. Each test plants or alters objects of a checkpoint the way that attacker would
(rewriting the manifest's sizes and digests to match what it planted, since it can read the format)
and checks that the trainer's restore refuses it with :class:`CheckpointError` before any loader sees
the planted bytes: the pickle's ``__reduce__`` would create a marker file, which must stay absent.

A one-rank gloo process group in this process; a real file object store under tmp_path; the run
secret in the environment, as the trainer ranks receive it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

RUN = "r"


class _Bomb:
    """Unpickling this object opens (creates) ``marker``: proof that a loader ran attacker code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))



@pytest.fixture()
def secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """The run secret, handed to this process the way the trainer service hands it to its ranks."""
    from infra.secrets import SECRET_ENV

    key = os.urandom(32)
    monkeypatch.setenv(SECRET_ENV, key.hex())
    return key


def _engine(seed: int) -> Any:
    from infra.config import TrainerConfig
    from infra.train.engines import TorchEngine

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return TorchEngine(model, TrainerConfig(lr=1e-2), world=1, rank=0)


def _train(engine: Any, n: int) -> None:
    for _ in range(n):
        engine.backward(engine.module(torch.randn(4, 8)).pow(2).mean())
        engine.step()


def _bomb_file(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"rng": _Bomb(marker), "step": 1, "rank": 0, "model": {}, "module": _Bomb(marker)}, buf)
    return buf.getvalue()


def _forge(store: Any, step: int, planted: dict[str, bytes]) -> None:
    """What a writer without the key does: plant objects, then make the manifest list them with their
    true sizes and sha256 digests (whatever fields the manifest has), keeping its old MAC."""
    from infra.train.checkpoint import ckpt_dir

    prefix = ckpt_dir(RUN, step)
    man = json.loads(store.get(f"{prefix}/manifest.json"))
    for rel, data in planted.items():
        key = f"{prefix}/{rel}"
        store.put(key, data)
        man["keys"][key] = len(data)
        if isinstance(man.get("sha256"), dict):
            man["sha256"][key] = hashlib.sha256(data).hexdigest()
    store.put(f"{prefix}/manifest.json", json.dumps(man).encode())


def _saved(tmp_path: Path, step: int = 1) -> tuple[Any, Any]:
    from infra.storage import open_store
    from infra.train import checkpoint

    store = open_store(f"file://{tmp_path / 'store'}")
    e = _engine(0)
    _train(e, 2)
    checkpoint.save(store, RUN, step, e, {"weights_version": step}, rank=0, world=1, keep=5)
    return store, e


def test_planted_rank_pickle_never_runs(group: None, secret: bytes, tmp_path: Path) -> None:
    """Finding 1 of issue #15: a pickle planted as the per-rank state file ``rank-00000.pt`` (with the
    manifest's sizes and digests rewritten by the attacker) never executes; restore refuses it."""
    from infra.train import checkpoint

    store, e = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _forge(store, 1, {"rank-00000.pt": _bomb_file(marker)})
    with pytest.raises(checkpoint.CheckpointError, match="MAC"):
        checkpoint.restore(store, RUN, 1, e, rank=0, world=1)
    assert not marker.exists()


def test_planted_replica_pickle_never_runs(group: None, secret: bytes, tmp_path: Path) -> None:
    """Finding 1 of issue #15: a pickle planted as the torch engine's ``files/replica.pt`` (digest
    rewritten by the attacker) never reaches ``torch.load``; restore raises CheckpointError."""
    from infra.train import checkpoint

    store, e = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _forge(store, 1, {"files/replica.pt": _bomb_file(marker)})
    with pytest.raises(checkpoint.CheckpointError, match="MAC"):
        checkpoint.restore(store, RUN, 1, e, rank=0, world=1)
    assert not marker.exists()


def test_unsigned_checkpoint_is_refused(group: None, secret: bytes, tmp_path: Path) -> None:
    """Finding 1 of issue #15: a manifest without a MAC (an attacker's, or one from a deltaloop that
    did not sign checkpoints) is refused, with the reason in the message."""
    from infra.train import checkpoint

    store, e = _saved(tmp_path)
    marker = tmp_path / "pwned"
    _forge(store, 1, {"rank-00000.pt": _bomb_file(marker)})
    key = f"{checkpoint.ckpt_dir(RUN, 1)}/manifest.json"
    man = json.loads(store.get(key))
    man.pop("mac", None)
    store.put(key, json.dumps(man).encode())
    with pytest.raises(checkpoint.CheckpointError, match="unsigned"):
        checkpoint.restore(store, RUN, 1, e, rank=0, world=1)
    assert not marker.exists()


def test_other_runs_key_is_refused(group: None, secret: bytes, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 1 of issue #15: a checkpoint signed with another run's secret (an attacker who holds
    some run's key, or copied a checkpoint between runs) does not verify under this run's key."""
    from infra.secrets import SECRET_ENV
    from infra.train import checkpoint

    store, e = _saved(tmp_path)
    monkeypatch.setenv(SECRET_ENV, os.urandom(32).hex())
    with pytest.raises(checkpoint.CheckpointError, match="MAC"):
        checkpoint.restore(store, RUN, 1, e, rank=0, world=1)


def test_flipped_byte_in_any_object_is_refused(group: None, secret: bytes, tmp_path: Path) -> None:
    """Finding 1 of issue #15: one byte changed in any object of a checkpoint (engine file, rank
    state, manifest) makes the restore fail with CheckpointError, leaving the engine untouched."""
    from infra.train import checkpoint

    store, _ = _saved(tmp_path)
    prefix = checkpoint.ckpt_dir(RUN, 1) + "/"
    keys = store.list(prefix)
    assert len(keys) >= 3
    for key in keys:
        original = store.get(key)
        for pos in (0, len(original) // 2, len(original) - 1):
            data = bytearray(original)
            data[pos] ^= 0x01
            store.put(key, bytes(data))
            fresh = _engine(7)
            before = {k: v.clone() for k, v in fresh.module.state_dict().items()}
            with pytest.raises(checkpoint.CheckpointError):
                checkpoint.restore(store, RUN, 1, fresh, rank=0, world=1)
            assert all(torch.equal(before[k], v) for k, v in fresh.module.state_dict().items()), key
        store.put(key, original)
    checkpoint.restore(store, RUN, 1, _engine(7), rank=0, world=1)  # intact again: restores


def test_signed_manifest_from_another_step_is_refused(group: None, secret: bytes, tmp_path: Path) -> None:
    """Finding 1 of issue #15: a validly signed manifest copied into another step's folder (a replay
    of old state under a newer step) is refused: the MAC covers the step and every object's key."""
    from infra.train import checkpoint

    store, e = _saved(tmp_path, step=1)
    checkpoint.save(store, RUN, 2, e, {"weights_version": 2}, rank=0, world=1, keep=5)
    store.put(f"{checkpoint.ckpt_dir(RUN, 2)}/manifest.json",
              store.get(f"{checkpoint.ckpt_dir(RUN, 1)}/manifest.json"))
    with pytest.raises(checkpoint.CheckpointError, match="step"):
        checkpoint.restore(store, RUN, 2, e, rank=0, world=1)


@pytest.mark.parametrize("name", ["files/../../escaped", "files//abs", "files/a/./b", "files/a\\..\\b",
                                  "other/thing", "rank-00001.json"])
def test_names_are_checked_before_anything_is_written(group: None, secret: bytes, tmp_path: Path,
                                                      name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 1 of issue #15 (defence in depth): even a manifest signed with the run's key cannot name
    an object outside the checkpoint's files or a rank this trainer does not have; nothing is written
    (the restore folder is under tmp_path here, so a traversing name would land in it)."""
    import tempfile

    from infra.train import checkpoint

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    store, e = _saved(tmp_path)
    key = f"{checkpoint.ckpt_dir(RUN, 1)}/manifest.json"
    man = json.loads(store.get(key))
    man.pop("mac")
    data = b"x"
    bad = f"{checkpoint.ckpt_dir(RUN, 1)}/{name}"
    man["keys"][bad] = len(data)
    man["sha256"][bad] = hashlib.sha256(data).hexdigest()
    store.put(key, json.dumps(checkpoint.sign_manifest(man, checkpoint.checkpoint_key())).encode())
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(checkpoint.CheckpointError, match="name"):
        checkpoint.restore(store, RUN, 1, e, rank=0, world=1)
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_planted_step_names_do_not_break_listing(group: None, secret: bytes, tmp_path: Path) -> None:
    """Finding 1 of issue #15: objects with step-like names planted next to real checkpoints
    (``step-abc``, ``step-1/x/manifest.json``) are not committed steps and do not crash the listing or
    the collection of old checkpoints."""
    from infra.train import checkpoint

    store, e = _saved(tmp_path, step=1)
    base = checkpoint.ckpt_dir(RUN, 0).rsplit("/", 1)[0]
    store.put(f"{base}/step-abc/manifest.json", b"{}")
    store.put(f"{base}/step-000009/x/manifest.json", b"{}")
    checkpoint.save(store, RUN, 2, e, {"weights_version": 2}, rank=0, world=1, keep=1)
    assert checkpoint.committed_steps(store, RUN) == [2]
    assert store.exists(f"{base}/step-abc/manifest.json")


def test_round_trip_with_the_key_is_exact(group: None, secret: bytes, tmp_path: Path) -> None:
    """A checkpoint written by a trainer holding the key restores weights, AdamW state and the RNG
    exactly (the RNG state is JSON, not a pickle)."""
    from infra.train import checkpoint

    import random

    import numpy as np

    store, a = _saved(tmp_path)
    prefix = checkpoint.ckpt_dir(RUN, 1)
    assert not [k for k in store.list(prefix + "/") if k.endswith(".pkl") or "/rank-" in k and k.endswith(".pt")]
    expect = (torch.randn(3), random.random(), np.random.rand())
    b = _engine(5)
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    man = checkpoint.restore(store, RUN, 1, b, rank=0, world=1)
    assert man["step"] == 1 and man["weights_version"] == 1
    assert all(torch.equal(a.module.state_dict()[k], v) for k, v in b.module.state_dict().items())
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    # The RNG was captured right after training a: the next draw matches a's next draw.
    assert torch.equal(torch.randn(3), expect[0]) and random.random() == expect[1] and np.random.rand() == expect[2]


def test_without_the_secret_nothing_is_signed_or_restored(group: None, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 1 of issue #15: a trainer without the run secret neither writes an unsigned checkpoint
    nor restores one unverified; the flow's process verifies with the key of its run folder."""
    from infra.secrets import SECRET_ENV, run_secret
    from infra.storage import open_store
    from infra.train import checkpoint

    run_dir = tmp_path / "run"
    monkeypatch.setenv(SECRET_ENV, run_secret(run_dir).hex())  # the ranks' environment
    store, e = _saved(tmp_path)
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(checkpoint.CheckpointError, match="secret"):
        checkpoint.restore(store, RUN, 1, e, rank=0, world=1)
    with pytest.raises(checkpoint.CheckpointError, match="secret"):
        checkpoint.save(open_store(f"file://{tmp_path / 'other'}"), RUN, 1, e, {}, rank=0, world=1, keep=1)
    man = checkpoint.read_manifest(store, RUN, 1, key=checkpoint.checkpoint_key(run_dir))
    assert man["step"] == 1 and man["world"] == 1
    assert checkpoint.restore(store, RUN, 1, e, rank=0, world=1, run_dir=run_dir)["step"] == 1


def _ds_engine(seed: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    pytest.importorskip("deepspeed")
    from infra.config import TrainerConfig
    from infra.train.ds import DeepSpeedEngine

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return DeepSpeedEngine(model, TrainerConfig(lr=1e-2, engine="deepspeed", zero_stage=1, micro_batch=4),
                           world=1, rank=0)


@pytest.mark.slow
def test_planted_deepspeed_pickle_never_runs(group: None, secret: bytes, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 1 of issue #15: a pickle planted as DeepSpeed's model-states file (which DeepSpeed's own
    loader unpickles with ``weights_only=False``), its digest rewritten by the attacker, never runs:
    the restore refuses the manifest; and DeepSpeed's loader, handed the file directly, refuses it too."""
    from infra.storage import open_store
    from infra.train import checkpoint

    store = open_store(f"file://{tmp_path / 'store'}")
    e = _ds_engine(0, monkeypatch)
    e.backward(e.module(torch.randn(4, 8)).pow(2).mean())
    e.step()
    checkpoint.save(store, RUN, 1, e, {"weights_version": 1}, rank=0, world=1, keep=5)
    planted = "files/ckpt/mp_rank_00_model_states.pt"
    assert f"{checkpoint.ckpt_dir(RUN, 1)}/{planted}" in checkpoint.read_manifest(store, RUN, 1)["keys"]
    marker = tmp_path / "pwned"
    bomb = _bomb_file(marker)
    _forge(store, 1, {planted: bomb})
    with pytest.raises(checkpoint.CheckpointError, match="MAC"):
        checkpoint.restore(store, RUN, 1, e, rank=0, world=1)
    assert not marker.exists()
    folder = tmp_path / "direct"  # past the manifest: the engine's loader itself
    e.save(folder)
    (folder / "ckpt" / "mp_rank_00_model_states.pt").write_bytes(bomb)
    with pytest.raises(Exception, match="Weights only load failed"):
        e.load(folder)
    assert not marker.exists()
