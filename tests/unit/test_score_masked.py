"""score_batch with masked samples (issue #16): the mask is stored with the scores, rewards are
summarised over scored samples only, and a batch damaged beyond ``loop.max_infra_failure_rate`` fails
the step as retryable without writing scores (a retry scores it again)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evals.registry import cached_environment
from infra.config import load_config
from infra.errors import is_retryable
from infra.stages.context import Cluster, RunContext
from infra.stages.evaluate import prompt_batch
from infra.stages.steps import score_batch
from infra.storage import get_json, open_store, put_json

ENVS = Path(__file__).resolve().parents[1] / "envs"
GROUP = 4


def _ctx(tmp_path: Path, mask_fraction: float, bound: float) -> RunContext:
    cfg = load_config("configs/demo.yaml", [
        "env.type=python", "env.entry=masked_env:make", f"env.paths=[{ENVS}]", "env.eval_problems=4",
        f"env.options={{mask_fraction: {mask_fraction}}}", f"trainer.group_size={GROUP}", "trainer.prompts_per_step=5",
        f"loop.max_infra_failure_rate={bound}",
    ])
    ctx = RunContext(cfg, "masked-run", tmp_path, open_store(f"file://{tmp_path}/store"), tracker=None)  # type: ignore[arg-type]
    env = cached_environment(cfg.env)
    items = env.train_items(1, cfg.trainer.prompts_per_step)
    put_json(ctx.store, ctx.key(1, "prompts.json"), prompt_batch(cfg.env, env, items))
    samples = [{"prompt_index": p, "text": f"{items[p].answer[:k]}", "token_ids": [1] * (k + 1), "logprobs": []}
               for p in range(len(items)) for k in range(GROUP)]
    put_json(ctx.store, ctx.key(1, "rollouts.json"), {"samples": samples, "group_size": GROUP, "version": 1})
    return ctx


def _expected_mask(ctx: RunContext) -> list[bool]:
    env = cached_environment(ctx.cfg.env)
    items = get_json(ctx.store, ctx.key(1, "prompts.json"))["items"]
    samples = get_json(ctx.store, ctx.key(1, "rollouts.json"))["samples"]
    from evals.env import Item

    return [env.is_masked(Item.from_json(items[s["prompt_index"]]), s["text"]) for s in samples]  # type: ignore[attr-defined]


def test_scores_keep_the_mask_and_summarise_scored_samples_only(tmp_path: Path) -> None:
    """Replays the fake-zero fault of issue #16 at the scoring stage: samples that could not be scored
    are stored as masked and left out of the step's reward statistics."""
    ctx = _ctx(tmp_path, mask_fraction=0.3, bound=1.0)
    mask = _expected_mask(ctx)
    assert 0 < sum(mask) < len(mask)
    out = score_batch(ctx, Cluster(None, None, None), 1)
    stored = get_json(ctx.store, ctx.key(1, "scores.json"))
    assert stored["masked"] == mask
    assert all(r == 0.0 and reason == "infra" for r, reason, m in zip(stored["rewards"], stored["reasons"], mask) if m)
    scored = [r for r, m in zip(stored["rewards"], mask) if not m]
    assert out["reward_mean"] == pytest.approx(sum(scored) / len(scored))
    assert out["masked_samples"] == sum(mask)
    assert out["infra_failure_rate"] == pytest.approx(sum(mask) / len(mask))
    assert out["sandbox_retries"] == 0


def test_score_batch_above_the_bound_fails_retryable_and_writes_nothing(tmp_path: Path) -> None:
    """Replays a mass infrastructure failure during scoring (issue #16): above the configured rate the
    step fails with a retryable one-line error naming the rate, the bound and the reasons, and no
    scores.json is written, so the retried task scores the batch again."""
    ctx = _ctx(tmp_path, mask_fraction=0.6, bound=0.1)
    mask = _expected_mask(ctx)
    assert sum(mask) / len(mask) > 0.1
    with pytest.raises(Exception) as info:
        score_batch(ctx, Cluster(None, None, None), 1)
    msg = str(info.value)
    assert is_retryable(info.value) and "\n" not in msg
    assert f"{sum(mask)}/{len(mask)}" in msg and "0.1" in msg and "infra" in msg
    assert not ctx.store.exists(ctx.key(1, "scores.json"))
