"""Masked samples in GRPO (issue #16): a sample whose scoring infrastructure failed is left out of its
group's advantage statistics, of the loss and of the token normaliser — never trained as a fake 0."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from infra.config import TinyModelConfig  # noqa: E402
from infra.model import build_tiny_model, build_tokenizer  # noqa: E402
from infra.rollout.engine import SamplingParams  # noqa: E402
from infra.rollout.local import LocalEngine  # noqa: E402
from infra.train.grpo import (build_batch, group_advantages, grpo_loss, loss_tokens, plan_batch,  # noqa: E402
                              select_rows)

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position=128)
PROMPTS = ["1,2,3,4,5,6=", "3,5,7,9,11,13="]
REWARDS = [1.0, 0.0, 0.7, 0.0, 1.0, 0.2, 0.9, 0.4, 0.0, 0.6]
MASKED = [False, True, False, False, True, False, False, True, False, False]


@pytest.mark.parametrize("norm", ["std", "none"])
def test_masked_advantages_equal_those_of_the_group_without_them(norm: str) -> None:
    """Replays the fake-zero fault of issue #16: an infra failure scored 0 shifted its group's mean and
    std. With the sample masked, the others' advantages are exactly those of the group without it."""
    adv = group_advantages(REWARDS, 5, norm=norm, masked=MASKED)
    for g in range(2):
        keep = [i for i in range(5 * g, 5 * g + 5) if not MASKED[i]]
        alone = group_advantages([REWARDS[i] for i in keep], len(keep), norm=norm)
        assert torch.equal(adv[keep], alone)
    assert adv[torch.tensor(MASKED)].eq(0).all()
    assert torch.equal(group_advantages(REWARDS, 5, norm=norm, masked=[False] * 10),
                       group_advantages(REWARDS, 5, norm=norm))


def test_groups_with_too_few_unmasked_samples_are_dropped() -> None:
    """Replays a preempted batch (issue #16) where a whole group, or all but one sample of it, could not
    be scored: such a group carries no comparison and contributes nothing."""
    rewards = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.0, 1.0]
    masked = [True] * 4 + [True, True, True, False] + [False, True, False, False]
    plan = plan_batch(rewards, 4, masked=masked, min_group_samples=2)
    assert plan.masked == 8 and plan.groups_dropped == 2
    assert plan.trainable == [False] * 8 + [True, False, True, True]
    assert plan.advantages[:8].eq(0).all()
    assert torch.equal(plan.advantages[[8, 10, 11]], group_advantages([1.0, 0.0, 1.0], 3))
    assert plan_batch(rewards, 4, masked=masked, min_group_samples=1).groups_dropped == 1
    with pytest.raises(ValueError, match="masked"):
        plan_batch(rewards, 4, masked=masked[:5])


def _setup() -> tuple:
    tok = build_tokenizer()
    model = build_tiny_model(SMALL, tok, seed=0)
    comps = LocalEngine(model, tok).generate(PROMPTS, 4, SamplingParams(max_new_tokens=8, stop=[], seed=2))
    return tok, model, comps


def _planned_loss(tok, model, comps, rewards, masked, kl_coef: float = 0.0, ref=None):  # type: ignore[no-untyped-def]
    plan = plan_batch(rewards, 4, masked=masked, min_group_samples=2)
    keep, counts, _ = select_rows(comps, plan.advantages, plan.trainable, merge=True, kl_coef=kl_coef)
    batch = build_batch(tok, PROMPTS, [comps[i] for i in keep], plan.advantages[keep], counts)
    total = loss_tokens(comps, plan.trainable)
    return grpo_loss(model, batch, total_tokens=total, kl_coef=kl_coef, ref_model=ref)[0], total, keep


def test_loss_with_a_masked_row_equals_the_loss_of_the_batch_without_it() -> None:
    """Replays an infra failure on two samples (issue #16): the loss, its gradient and its token
    normaliser with those samples masked equal those of the batch that never had them."""
    tok, model, comps = _setup()
    rewards = [1.0, 0.0, 0.0, 0.5, 0.0, 1.0, 0.25, 0.0]
    masked = [False, False, True, False, False, False, False, True]
    loss_m, total_m, keep = _planned_loss(tok, model, comps, rewards, masked)
    assert 2 not in keep and 7 not in keep
    rest = [i for i in range(8) if not masked[i]]
    adv = torch.cat([group_advantages([rewards[i] for i in rest[:3]], 3),
                     group_advantages([rewards[i] for i in rest[3:]], 3)])
    without = build_batch(tok, PROMPTS, [comps[i] for i in rest], adv)
    loss_w, _ = grpo_loss(model, without)
    assert total_m == float(without["completion_mask"].sum())
    assert loss_m.item() == pytest.approx(loss_w.item(), rel=1e-6, abs=1e-9)
    for a, b in zip(torch.autograd.grad(loss_m, list(model.parameters())),
                    torch.autograd.grad(loss_w, list(model.parameters()))):
        assert torch.allclose(a, b, atol=1e-7)
    fake_zero, _, _ = _planned_loss(tok, model, comps, rewards, [False] * 8)  # the fault: masked scored as 0
    assert fake_zero.item() != pytest.approx(loss_w.item(), rel=1e-3)


def test_masked_rows_stay_out_with_a_kl_term_and_a_fully_masked_batch_trains_nothing() -> None:
    """Replays a batch whose every sample hit an infra failure (issue #16): nothing is trained, also
    with a KL penalty (which otherwise keeps every row)."""
    tok, model, comps = _setup()
    masked = [True, False, False, False, False, False, False, True]
    plan = plan_batch([0.0] * 8, 4, masked=masked)
    keep, _, _ = select_rows(comps, plan.advantages, plan.trainable, merge=False, kl_coef=0.1)
    assert keep == [1, 2, 3, 4, 5, 6]
    loss, total, keep = _planned_loss(tok, model, comps, [1.0] * 8, [True] * 8, kl_coef=0.1,
                                      ref=build_tiny_model(SMALL, tok, seed=1))
    assert total == 1.0 and loss.item() == 0.0
