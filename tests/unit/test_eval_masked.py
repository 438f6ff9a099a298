"""Evaluation with masked samples (issue #16): a sample the sandbox infrastructure could not score is
neither right nor wrong — it is left out of the suite's means, pass@k and paired comparisons, and
counted as ``masked``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from evals.registry import cached_environment
from infra.config import load_config
from infra.stages.evaluate import Suite, evaluate_suite, paired_gain

ENVS = Path(__file__).resolve().parents[1] / "envs"


def _suite(samples: int, mask_fraction: float) -> Suite:
    cfg = load_config("configs/demo.yaml", [
        "env.type=python", "env.entry=masked_env:make", f"env.paths=[{ENVS}]", "env.eval_problems=12",
        f"env.options={{mask_fraction: {mask_fraction}}}",
    ])
    return Suite("main", cfg.env, "heldout", 12, 8, temperature=1.0 if samples > 1 else 0.0, samples=samples,
                 ks=(1, 2))


def _generate(batch: dict[str, Any], n: int, temperature: float, max_new_tokens: int) -> tuple[list[str], float]:
    """Completions that differ per sample (the masked env's verdicts depend on the text)."""
    return [f"{item['answer'][: k + 1]}" for item in batch["items"] for k in range(n)], 0.0


def test_masked_samples_are_not_counted_wrong_in_an_evaluation() -> None:
    """Replays an evaluation during which the sandbox infrastructure failed on some samples (issue
    #16): the report's means are over scored samples only, as if the masked ones were never drawn."""
    suite = _suite(samples=3, mask_fraction=0.7)
    env = cached_environment(suite.env)
    rep = evaluate_suite(suite, _generate, None)
    items = env.heldout_items(12)
    texts, _ = _generate({"items": [it.to_json() for it in items]}, 3, 1.0, 8)
    per = [[(env.reward(it, t), env.is_masked(it, t)) for t in texts[3 * i:3 * i + 3]] for i, it in enumerate(items)]
    scored = [[r for r, m in p if not m] for p in per]
    assert rep["masked"] == sum(m for p in per for _, m in p) > 0
    assert rep["masked_problems"] == [not s for s in scored] and any(rep["masked_problems"])
    means = [sum(s) / len(s) for s in scored if s]
    assert rep["score"] == pytest.approx(sum(means) / len(means))
    assert rep["accuracy"] == pytest.approx(sum(sum(r >= 1.0 for r in s) / len(s) for s in scored if s) / len(means))
    enough = [s for s in scored if len(s) >= 2]
    assert rep["pass_at_k"]["problems"] == len(enough)
    assert rep["pass_at_k"]["pass@1"] == pytest.approx(sum(sum(r >= 1.0 for r in s) / len(s) for s in enough)
                                                       / len(enough))


def test_paired_gain_leaves_out_problems_masked_in_either_report() -> None:
    """Replays a before/after comparison where one problem could not be scored after training (issue
    #16): its placeholder 0 must not read as a regression."""
    before = {"problem_ids": ["a", "b", "c", "d"], "rewards": [1.0, 0.0, 1.0, 0.5],
              "masked_problems": [False, False, False, False]}
    after = {"problem_ids": ["a", "b", "c", "d"], "rewards": [1.0, 0.5, 0.0, 1.0],
             "masked_problems": [False, False, True, False]}
    low, high = paired_gain(before, after)  # type: ignore[misc]
    assert low >= 0.0 and high == pytest.approx(0.5)
    assert paired_gain(before, {**after, "masked_problems": [True] * 4}) is None
