"""Tokenizer and model building, HF save/load, and the published-state round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import TinyModelConfig  # noqa: E402
from infra.model import (  # noqa: E402
    build_tiny_model,
    build_tokenizer,
    load_policy,
    load_published_state,
    publishable_state,
    save_hf,
)

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=128)


def test_tokenizer_round_trip_and_specials() -> None:
    tok = build_tokenizer()
    text = "3,5,7,9,11,13=2*x+3\n(x+1)*4 x%3+2"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id} == {0, 1, 2}


def test_save_hf_opens_with_auto_classes(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = build_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0)
    save_hf(model, tok, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    ids = torch.tensor([tok2("12,13=")["input_ids"]])
    assert tok2.decode(ids[0], skip_special_tokens=True) == "12,13="
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-6)


def test_build_is_seeded() -> None:
    tok = build_tokenizer()
    a, b, c = (build_tiny_model(SMALL, tok, seed=s) for s in (1, 1, 2))
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(pa[name], pb[name]) and not torch.equal(pa[name], pc[name])


def test_published_state_round_trip() -> None:
    tok = build_tokenizer()
    src = build_tiny_model(SMALL, tok, seed=1)
    dst = build_tiny_model(SMALL, tok, seed=2)
    state = publishable_state(src)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    load_published_state(dst, state)
    for name, p in dst.named_parameters():
        assert torch.equal(p.data, state[name].float())
    with pytest.raises(KeyError):
        load_published_state(dst, {k: v for k, v in state.items() if "lm_head" not in k})


class _Plant:
    """A pickle payload: unpickling it creates ``path`` (proof that code ran)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def test_model_folder_with_pickled_weights_is_never_unpickled(tmp_path: Path) -> None:
    """Someone who can write a registered model's folder replaces ``model.safetensors`` with a
    ``pytorch_model.bin`` pickle (finding 1 of issue #15, applied to model folders). transformers'
    own ``weights_only`` load would already refuse this payload; deltaloop does not open ``.bin``
    files at all, so the refusal does not rest on the unpickler's allow-list."""
    import pickle

    from infra.config import ModelConfig

    tok = build_tokenizer()
    folder = save_hf(build_tiny_model(SMALL, tok, seed=0), tok, tmp_path / "model")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"w": _Plant(marker)}, f)
    with pytest.raises(OSError):
        load_policy(ModelConfig(), folder=folder)
    assert not marker.exists()
