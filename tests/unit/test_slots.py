"""SlotRunner: shared-prefix prefill equals per-prompt prefill; grouped-query attention matches HF."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import TinyModelConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer  # noqa: E402
from infra.rollout.engine import SamplingParams  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402
from infra.rollout.slots import SlotRunner  # noqa: E402
from infra.train.grpo import build_batch, token_logprobs  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64, max_position=256)
# shared prefixes ("1,2," / "1,2,3"), an exact duplicate, a one-token-longer prompt and a short one
PROMPTS = ["1,2,3,4=", "1,2,9=", "1,2,3,4=", "1,2,3,4,=", "7=", "10,20,30="]


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return build_tokenizer()


def _gqa_model(tok):  # noqa: ANN001, ANN202
    """A Llama with 4 query heads sharing 2 key/value heads (what SmolLM2 has, 9 over 3)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(1)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("gqa", [False, True])
def test_shared_prefix_prefill_equals_one_prompt_at_a_time(tok, gqa: bool) -> None:  # noqa: ANN001
    model = _gqa_model(tok) if gqa else build_tiny_model(SMALL, tok, seed=0).eval()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    together, alone = SlotRunner(model), SlotRunner(model)
    with torch.inference_mode():
        for r in (together, alone):
            r.refresh()
            r.reserve(len(ids), 64)
        batch_logits = together.prefill(list(range(len(ids))), ids)
        one_logits = torch.cat([alone.prefill([s], [p]) for s, p in enumerate(ids)])
        # the model's own forward, one prompt at a time
        hf = torch.cat([model(torch.tensor([p])).logits[:, -1].float() for p in ids])
    assert batch_logits == pytest.approx(one_logits, abs=1e-5)
    assert batch_logits == pytest.approx(hf, abs=1e-4)
    for s, p in enumerate(ids):  # every slot's cache holds its own prompt, duplicates included
        n = len(p)
        assert together.k_cache[:, s, :, :n] == pytest.approx(alone.k_cache[:, s, :, :n], abs=1e-5)
        assert together.v_cache[:, s, :, :n] == pytest.approx(alone.v_cache[:, s, :, :n], abs=1e-5)


def test_gqa_logprobs_match_teacher_forcing_and_hf_path(tok) -> None:  # noqa: ANN001
    model = _gqa_model(tok)
    fast = LocalEngine(model, tok, max_batch=5)
    assert fast.continuous
    params = SamplingParams(max_new_tokens=10, temperature=0.9, stop=["\n"], seed=4)
    comps = fast.generate(PROMPTS, 2, params)
    batch = build_batch(tok, PROMPTS, comps, [0.0] * len(comps))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 0.9)
    assert ((lp - batch["old_logprobs"]) * batch["completion_mask"]).abs().max().item() < 1e-3
    slow = LocalEngine(model, tok, max_batch=5)
    slow._runner = None  # the generic Hugging Face path
    assert [c.token_ids for c in slow.generate(PROMPTS, 2, params)] == [c.token_ids for c in comps]
