"""Guard suites, CI level and the gate's renderings, on crafted eval results."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from evals.gate import check_guards, decide_with_guards, slices_by_prefix
from infra.config import PromoteConfig
from infra.ops.report import gate_report
from infra.stages.gate import gate_rewards


def _suite(n_per_family: int = 60, p: float = 0.4, seed: int = 0) -> tuple[list[str], list[float]]:
    rng = random.Random(seed)
    ids = [f"{fam}|{i}|0" for fam in ("a*x+b", "x%a+b", "(x+a)*b") for i in range(n_per_family)]
    return ids, [float(rng.random() < p) for _ in ids]


def test_slices_by_prefix_groups_families() -> None:
    s = slices_by_prefix(["f|1|2", "g|3|4", "f|5|6"], [1.0, 0.0, 0.5])
    assert s == {"f": [1.0, 0.5], "g": [0.0]}
    with pytest.raises(ValueError):
        slices_by_prefix(["f|1"], [])


def test_better_overall_but_one_family_collapses_is_rejected() -> None:
    ids, champ = _suite()
    cand = list(champ)
    for i, pid in enumerate(ids):  # two families improve a lot, the third loses everything
        fam = pid.split("|")[0]
        cand[i] = 1.0 if fam != "x%a+b" else 0.0
    d = gate_rewards(ids, cand, champ, PromoteConfig(guard_tolerance=0.05))
    assert d.improvement is not None and d.improvement > 0.1 and d.ci_low is not None and d.ci_low > 0
    assert not d.promote and "guard 'x%a+b' regressed" in d.reason
    assert [g.suite for g in d.guards if not g.ok] == ["x%a+b"]
    # with guards disabled the same candidate passes
    assert gate_rewards(ids, cand, champ, PromoteConfig(guard_tolerance=1.0)).promote


def test_small_guard_drop_within_tolerance_promotes() -> None:
    ids, champ = _suite(p=0.3)
    cand = [1.0 if (c == 1.0 or i % 3 == 0) else 0.0 for i, c in enumerate(champ)]
    fam0 = [i for i, pid in enumerate(ids) if pid.startswith("a*x+b")]
    dropped = [i for i in fam0 if cand[i] == 1.0][:2]  # -2/60 = -0.033 on one family
    for i in dropped:
        cand[i] = 0.0
    d = gate_rewards(ids, cand, champ, PromoteConfig(guard_tolerance=0.05))
    assert d.promote, d.reason
    assert all(g.ok for g in d.guards) and "3/3 guards within tolerance" in d.reason


def test_not_significant_is_rejected_and_confidence_matters() -> None:
    ids, champ = _suite(n_per_family=40, p=0.5, seed=3)
    cand = list(champ)
    flips = [i for i, c in enumerate(champ) if c == 0.0][:6]  # +6/120 = +0.05
    for i in flips:
        cand[i] = 1.0
    strict = gate_rewards(ids, cand, champ, PromoteConfig(confidence=0.99, margin=0.0))
    loose = gate_rewards(ids, cand, champ, PromoteConfig(confidence=0.5, margin=0.0))
    assert strict.ci_low is not None and loose.ci_low is not None and strict.ci_low <= loose.ci_low
    assert strict.confidence == 0.99
    worse = gate_rewards(ids, champ, cand, PromoteConfig())
    assert not worse.promote and worse.improvement is not None and worse.improvement < 0


def test_check_guards_tolerance_per_suite_and_errors() -> None:
    g = check_guards({"a": [0.0, 0.0], "b": [1.0]}, {"a": [1.0, 0.0], "b": [1.0], "c": [1.0]}, {"a": 0.6})
    assert [(x.suite, x.ok) for x in g] == [("a", True), ("b", True)]
    with pytest.raises(ValueError):
        check_guards({"a": [1.0]}, {"a": [1.0, 0.0]}, 0.1)


def test_no_champion_skips_guards() -> None:
    d = decide_with_guards([0.1], None, 0.0, {"a": [0.1]}, None)
    assert d.promote and d.guards == []


def test_gate_report_markdown_has_numbers_and_reason() -> None:
    ids, champ = _suite()
    cand = [1.0] * len(champ)
    d = asdict(gate_rewards(ids, cand, champ, PromoteConfig()))
    md = gate_report(d, "7", "3", "[MLflow run x](http://h/#/x)", suite="s")
    assert "PROMOTED" in md and "| main suite |" in md and "## Guard suites" in md and "**Reason:**" in md
    assert "CI95" in md and "http://h/#/x" in md


def test_unscored_problems_are_left_out_not_counted_as_zero() -> None:
    """Issue #16: a problem whose every eval sample was masked (infrastructure failure) reports 0.0;
    the gate must compare the problems both sides scored, exactly as if the others were absent."""
    from infra.stages.gate import unscored_problems

    ids, champ = _suite(seed=3)
    cand = [min(1.0, r + 0.5) for r in champ]
    gone = [i % 7 == 0 for i in range(len(ids))]
    cand_report = {"masked_problems": gone}
    champ_report = {"masked_problems": [False] * len(ids)}
    unscored = unscored_problems(cand_report, champ_report)
    assert unscored == gone and unscored_problems(champ_report, None) is None
    zeroed = [0.0 if g else c for c, g in zip(cand, gone)]  # what the report holds for them
    pcfg = PromoteConfig(guard_tolerance=0.05)
    kept = [i for i, g in enumerate(gone) if not g]
    left_out = gate_rewards(ids, zeroed, champ, pcfg, unscored=unscored)
    reduced = gate_rewards([ids[i] for i in kept], [cand[i] for i in kept], [champ[i] for i in kept], pcfg)
    assert asdict(left_out) == asdict(reduced)
    nothing = gate_rewards(ids, zeroed, champ, pcfg, unscored=[True] * len(ids))
    assert not nothing.promote and "no evaluation problem was scored" in nothing.reason
