"""GRPO math: group advantages, loss gradients, shard normalisation; SFT warm-start reduces loss."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import TinyModelConfig, WarmstartConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer  # noqa: E402
from infra.rollout.engine import SamplingParams  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402
from infra.train.grpo import (build_batch, drop_zero_advantage, group_advantages, grpo_loss,  # noqa: E402
                              merge_duplicates, token_logprobs)
from infra.train.sft import sft_batch, sft_loss, warmstart  # noqa: E402

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=128)
PROMPTS = ["1,2,3,4,5,6=", "3,5,7,9,11,13="]


def test_group_advantages() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-3)
    assert torch.equal(adv[4:], torch.zeros(4))
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0, 1.0], 2)


def test_group_advantages_without_std() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], 4, norm="none")  # Dr. GRPO: mean-centred only
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    with pytest.raises(ValueError, match="advantage norm"):
        group_advantages([1.0, 0.0], 2, norm="max")


def test_clip_higher_clips_only_above_its_own_bound() -> None:
    tok, model, comps = _setup()
    batch = build_batch(tok, PROMPTS, comps, torch.ones(8))
    batch["old_logprobs"] = batch["old_logprobs"] - 0.25 * batch["completion_mask"]  # ratio e^0.25 = 1.28
    _, sym = grpo_loss(model, batch, clip_eps=0.2)
    _, high = grpo_loss(model, batch, clip_eps=0.2, clip_eps_high=0.3)
    assert sym["clip_frac"] == pytest.approx(1.0) and high["clip_frac"] == 0.0


def _setup() -> tuple:
    tok = build_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0)
    comps = LocalEngine(model, tok).generate(PROMPTS, 4, SamplingParams(max_new_tokens=8, stop=[], seed=2))
    return tok, model, comps


def test_positive_advantage_raises_logprob() -> None:
    tok, model, comps = _setup()
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    batch = build_batch(tok, PROMPTS, comps, adv)
    loss, m = grpo_loss(model, batch)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["clip_frac"] == 0.0 and m["entropy"] > 0
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
        lp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
    seq = ((lp - batch["old_logprobs"]) * batch["completion_mask"]).sum(1)
    assert seq[0] > 0 and (seq[1:4] < 0).all()


def test_shards_sum_to_global_token_mean() -> None:
    tok, model, comps = _setup()
    adv = group_advantages([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0], 4)
    full = build_batch(tok, PROMPTS, comps, adv)
    total = float(full["completion_mask"].sum())
    loss, _ = grpo_loss(model, full, total_tokens=total)
    g_full = torch.autograd.grad(loss, list(model.parameters()))
    g_sum = [torch.zeros_like(g) for g in g_full]
    for shard in (list(range(0, 8, 2)), list(range(1, 8, 2))):  # rank-strided shards, prompts positional
        b = build_batch(tok, [PROMPTS[comps[i].prompt_index] for i in shard], [comps[i] for i in shard], adv[shard],
                        positional=True)
        l_s, _ = grpo_loss(model, b, total_tokens=total)
        for acc, g in zip(g_sum, torch.autograd.grad(l_s, list(model.parameters()))):
            acc += g
    for a, b in zip(g_full, g_sum):
        assert torch.allclose(a, b, atol=1e-5)


def test_merged_duplicates_give_the_same_gradient() -> None:
    tok, model, comps = _setup()
    dup = [comps[0], comps[1], comps[0], comps[4], comps[0], comps[4]]  # same prompt and tokens repeat
    dup = [type(c)(**{**c.__dict__}) for c in dup]
    adv = torch.tensor([1.0, -0.5, 1.0, 0.3, 1.0, 0.3])
    keep, counts = merge_duplicates(dup)
    assert keep == [0, 1, 3] and counts == [3, 1, 2]
    full = build_batch(tok, PROMPTS, dup, adv)
    total = float(full["completion_mask"].sum())
    loss_a, m_a = grpo_loss(model, full, total_tokens=total, kl_coef=0.05, ref_model=build_tiny_model(SMALL, tok, 3))
    g_a = torch.autograd.grad(loss_a, list(model.parameters()))
    merged = build_batch(tok, PROMPTS, [dup[i] for i in keep], adv[keep], counts)
    loss_b, m_b = grpo_loss(model, merged, total_tokens=total, kl_coef=0.05, ref_model=build_tiny_model(SMALL, tok, 3))
    g_b = torch.autograd.grad(loss_b, list(model.parameters()))
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-5)
    assert m_a["tokens"] == m_b["tokens"] and m_a["entropy"] == pytest.approx(m_b["entropy"], rel=1e-5)
    for a, b in zip(g_a, g_b):
        assert torch.allclose(a, b, atol=1e-6)
    zero = build_batch(tok, PROMPTS, [dup[0]], adv[:1], [0.0])  # the padding row of a short rank
    loss_z, _ = grpo_loss(model, zero, total_tokens=total)
    assert loss_z.item() == 0.0


def test_prompts_by_index_unless_positional() -> None:
    tok, _, comps = _setup()
    rows = [comps[4], comps[0]]  # two rows, as many as there are prompts, of prompts 1 and 0
    by_index = build_batch(tok, PROMPTS, rows, [0.0, 0.0])
    assert by_index["input_ids"][0, 1:1 + len(PROMPTS[1])].tolist() == tok(PROMPTS[1])["input_ids"][1:]
    shard = build_batch(tok, [PROMPTS[1], PROMPTS[0]], rows, [0.0, 0.0], positional=True)
    assert torch.equal(by_index["input_ids"], shard["input_ids"])
    with pytest.raises(ValueError, match="positional"):
        build_batch(tok, PROMPTS, comps, [0.0] * 8, positional=True)


def test_zero_advantage_rows_are_skipped_with_the_same_gradient() -> None:
    tok, model, comps = _setup()
    adv = group_advantages([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0], 4)  # group 0 all alike: advantage 0
    keep, counts, skipped = drop_zero_advantage(list(range(8)), [1] * 8, adv, kl_coef=0.0)
    assert keep == [4, 5, 6, 7] and counts == [1] * 4 and skipped == 4
    full = build_batch(tok, PROMPTS, comps, adv)
    total = float(full["completion_mask"].sum())
    g_full = torch.autograd.grad(grpo_loss(model, full, total_tokens=total)[0], list(model.parameters()))
    part = build_batch(tok, PROMPTS, [comps[i] for i in keep], adv[keep], counts)
    g_part = torch.autograd.grad(grpo_loss(model, part, total_tokens=total)[0], list(model.parameters()))
    for a, b in zip(g_full, g_part):
        assert torch.allclose(a, b, atol=1e-7)
    assert drop_zero_advantage(list(range(8)), [1] * 8, adv, kl_coef=0.1) == (list(range(8)), [1] * 8, 0)
    assert drop_zero_advantage([0, 1], [2, 1], torch.zeros(2), kl_coef=0.0) == ([0], [0], 2)


def test_kl_to_reference() -> None:
    tok, model, comps = _setup()
    batch = build_batch(tok, PROMPTS, comps, torch.zeros(8))
    _, m0 = grpo_loss(model, batch, kl_coef=0.1, ref_model=model)
    assert m0["kl"] == pytest.approx(0.0, abs=1e-6)
    ref = build_tiny_model(SMALL, tok, seed=1)
    _, m1 = grpo_loss(model, batch, kl_coef=0.1, ref_model=ref)
    assert m1["kl"] > 0
    with pytest.raises(ValueError):
        grpo_loss(model, batch, kl_coef=0.1)


def test_warmstart_reduces_loss() -> None:
    tok = build_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0)
    from evals.funcfit import sft_examples

    probe = sft_batch(tok, sft_examples(99, 32))
    with torch.no_grad():
        before = sft_loss(model, probe).item()
    out = warmstart(model, tok, WarmstartConfig(steps=15, batch_size=16, lr=3e-3, warmup_steps=2), sft_examples,
                    seed=0)
    with torch.no_grad():
        after = sft_loss(model, probe).item()
    assert out["steps"] == 15 and after < before - 0.5
