"""Promotion gate decisions on crafted eval results."""

from __future__ import annotations

import random

import pytest

from evals.gate import decide, paired_bootstrap


def test_no_champion_promotes() -> None:
    d = decide([0.5, 0.6], None, margin=0.0)
    assert d.promote and d.reason == "no current champion"


def test_clearly_better_promotes_and_worse_rejects() -> None:
    rng = random.Random(1)
    champ = [float(rng.random() < 0.3) for _ in range(300)]
    better = [1.0 if (c == 1.0 or rng.random() < 0.3) else 0.0 for c in champ]
    d = decide(better, champ, margin=0.0)
    assert d.promote and d.method == "paired_bootstrap" and d.ci_low is not None and d.ci_low > 0
    d2 = decide(champ, better, margin=0.0)
    assert not d2.promote and d2.improvement is not None and d2.improvement < 0


def test_identical_or_noise_is_not_promoted() -> None:
    rng = random.Random(2)
    champ = [float(rng.random() < 0.4) for _ in range(300)]
    assert not decide(list(champ), champ, margin=0.0).promote
    noisy = list(champ)
    noisy[0], noisy[1] = 1.0, 1.0  # a tiny, not significant gain
    assert not decide(noisy, champ, margin=0.0).promote


def test_margin_respected() -> None:
    champ = [0.0] * 200
    cand = [0.0] * 180 + [1.0] * 20  # +0.10 improvement
    assert decide(cand, champ, margin=0.0).promote
    assert not decide(cand, champ, margin=0.2).promote


def test_mean_fallback() -> None:
    assert decide([1.0, 1.0], None, margin=0.05, champion_score=0.5).promote
    assert not decide([0.5, 0.5], None, margin=0.0, champion_score=0.5).promote


def test_errors() -> None:
    with pytest.raises(ValueError):
        decide([], None, 0.0)
    with pytest.raises(ValueError):
        decide([1.0], [1.0, 0.0], 0.0)
    lo, hi = paired_bootstrap([0.1] * 10)
    assert lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
