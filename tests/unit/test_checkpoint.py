"""Trainer checkpoints: exact round trip (weights, AdamW state, RNG), atomic commit, GC, guards.

A one-rank gloo process group in this process; a file object store under tmp_path; the run secret in
the environment (tests/unit/test_checkpoint_security.py covers forged and altered checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.checkpoint_helpers import set_run_secret, tiny_engine  # noqa: E402


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run secret in the environment, as the trainer ranks receive it (checkpoints are signed)."""
    set_run_secret(monkeypatch)


def _steps(engine, n: int) -> None:  # noqa: ANN001
    for _ in range(n):
        x = torch.randn(4, 8)  # draws from the global RNG: restored RNG => same data
        engine.backward(engine.module(x).pow(2).mean())
        engine.step()


def test_round_trip_is_exact(group: None, tmp_path: Path) -> None:
    from infra.storage import open_store
    from infra.train import checkpoint

    store = open_store(f"file://{tmp_path}")
    a = tiny_engine(0)
    _steps(a, 3)
    checkpoint.save(store, "r", 3, a, {"weights_version": 4}, rank=0, world=1, keep=2)
    _steps(a, 2)
    b = tiny_engine(123)  # different init: everything must come from the checkpoint
    _steps(b, 1)
    man = checkpoint.restore(store, "r", 3, b, rank=0, world=1)
    assert man["weights_version"] == 4 and man["step"] == 3
    _steps(b, 2)
    for (ka, pa), (kb, pb) in zip(a.module.state_dict().items(), b.module.state_dict().items()):
        assert ka == kb and torch.equal(pa, pb)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k])


def test_uncommitted_checkpoint_is_invisible(group: None, tmp_path: Path) -> None:
    from infra.storage import open_store
    from infra.train import checkpoint

    store = open_store(f"file://{tmp_path}")
    e = tiny_engine(0)
    checkpoint.save(store, "r", 1, e, {"weights_version": 1}, rank=0, world=1, keep=5)
    checkpoint.save(store, "r", 2, e, {"weights_version": 2}, rank=0, world=1, keep=5)
    store.delete(f"{checkpoint.ckpt_dir('r', 2)}/manifest.json")  # as if killed before the commit
    assert checkpoint.committed_steps(store, "r") == [1]
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.restore(store, "r", 2, e, rank=0, world=1)


def test_collect_keeps_step0_and_newest(group: None, tmp_path: Path) -> None:
    from infra.storage import open_store
    from infra.train import checkpoint

    store = open_store(f"file://{tmp_path}")
    e = tiny_engine(0)
    for step in range(0, 6):
        checkpoint.save(store, "r", step, e, {"weights_version": step + 1}, rank=0, world=1, keep=2)
    assert checkpoint.committed_steps(store, "r") == [0, 4, 5]
    assert not store.list(checkpoint.ckpt_dir("r", 2) + "/")  # nothing left behind


def test_restore_refuses_other_world_size(group: None, tmp_path: Path) -> None:
    from infra.storage import open_store
    from infra.train import checkpoint

    store = open_store(f"file://{tmp_path}")
    e = tiny_engine(0)
    checkpoint.save(store, "r", 1, e, {"weights_version": 1}, rank=0, world=1, keep=2)
    with pytest.raises(checkpoint.CheckpointError, match="2"):
        checkpoint.restore(store, "r", 1, e, rank=0, world=2)


def test_lora_adapters_publish_and_merge() -> None:
    """Adapter-only state applied to a plain model gives the peft model's outputs."""
    pytest.importorskip("peft")
    from infra.config import LoraConfig, TinyModelConfig
    from infra.model import build_tiny_model, build_tokenizer
    from infra.train.lora import (apply_lora, base_weights, is_adapter_state, load_published_adapters,
                                  merged_state, publishable_adapter_state)

    tok = build_tokenizer()
    shape = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    lcfg = LoraConfig(enabled=True, rank=4, alpha=8.0)
    peft_model = apply_lora(build_tiny_model(shape, tok, 0), lcfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # B starts at 0; make the adapters do something
    named = dict(peft_model.named_parameters())
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable < sum(p.numel() for p in peft_model.parameters()) / 5
    pub = publishable_adapter_state(named, lcfg.alpha / lcfg.rank)
    assert is_adapter_state(pub) and all(t.dtype == torch.bfloat16 for t in pub.values())
    served = build_tiny_model(shape, tok, 0)  # the rollout worker's plain copy of the base model
    load_published_adapters(served, base_weights(served, pub), pub)
    merged = build_tiny_model(shape, tok, 0)
    merged.load_state_dict(merged_state(named, lcfg.alpha / lcfg.rank))
    ids = torch.tensor([tok("x*x+1")["input_ids"]])
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)
        assert torch.allclose(served(input_ids=ids).logits, want, atol=5e-2)  # bf16 adapters
