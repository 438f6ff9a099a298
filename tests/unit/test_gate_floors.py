"""Production floors: a candidate below a suite's absolute minimum is never promoted, champion or not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from evals.gate import check_floors, decide, veto_floors
from infra.config import ConfigError, PromoteConfig, load_config, validate_config
from infra.stages.gate import extra_suites_needed, gate_rewards

ROOT = Path(__file__).resolve().parents[2]


def _ids(n: int = 40) -> list[str]:
    return [f"x+b|{i}|0" for i in range(n)]


def test_no_champion_and_zero_score_is_not_promoted() -> None:
    """The SmolLM2 case: 0.000 with no champion used to become champion."""
    d = gate_rewards(_ids(), [0.0] * 40, None, PromoteConfig(floors={"main": 0.05}))
    assert not d.promote
    assert "no current champion" in d.reason and "suite 'main' scored 0.0000 < floor 0.0500" in d.reason
    assert [(f.suite, f.score, f.floor, f.ok) for f in d.floors] == [("main", 0.0, 0.05, False)]


def test_no_champion_above_floor_is_promoted() -> None:
    d = gate_rewards(_ids(), [1.0] * 4 + [0.0] * 36, None, PromoteConfig(floors={"main": 0.1}))
    assert d.promote and "1 floor(s) met" in d.reason and d.floors[0].ok  # 0.1 exactly meets 0.1


def test_floor_vetoes_a_significant_improvement() -> None:
    champ = [0.0] * 200
    cand = [0.0] * 180 + [1.0] * 20  # +0.10, significant, but an absolute 0.10
    pcfg = PromoteConfig(floors={"main": 0.2})
    d = gate_rewards([f"f|{i}|0" for i in range(200)], cand, champ, pcfg)
    assert d.method == "paired_bootstrap" and d.improvement == pytest.approx(0.1)
    assert not d.promote and ", but below the production floor" in d.reason


def test_extra_suite_floor_reads_its_report_and_fails_closed_without_one() -> None:
    pcfg = PromoteConfig(floors={"main": 0.05, "humaneval": 0.3})
    main = [1.0] * 20 + [0.0] * 20
    ok = gate_rewards(_ids(), main, None, pcfg, suites={"humaneval": {"rewards": [1.0, 0.0, 1.0]}})
    assert ok.promote and [f.ok for f in ok.floors] == [True, True]
    low = gate_rewards(_ids(), main, None, pcfg, suites={"humaneval": {"rewards": [0.0, 0.0, 0.0, 1.0]}})
    assert not low.promote and "suite 'humaneval' scored 0.2500 < floor 0.3000" in low.reason
    assert "'main'" not in low.reason.split("floor:")[1]  # main (0.5) met its floor
    missing = gate_rewards(_ids(), main, None, pcfg)
    assert not missing.promote and "suite 'humaneval' has no result for its floor 0.3000" in missing.reason


def test_check_floors_and_veto_on_an_already_rejected_decision() -> None:
    checks = check_floors({"main": 0.02, "other": 0.5}, {"main": 0.05, "other": 0.4})
    assert [(c.suite, c.ok) for c in checks] == [("main", False), ("other", True)]
    rejected = decide([0.0, 0.0], [1.0, 1.0], margin=0.0)
    out = veto_floors(rejected, checks)
    assert not out.promote and "; below the production floor: suite 'main' scored 0.0200 < floor 0.0500" in out.reason


def test_no_floors_leave_the_decision_alone() -> None:
    d = gate_rewards(_ids(), [0.0] * 40, None, PromoteConfig())
    assert d.promote and d.reason == "no current champion" and d.floors == []


def test_config_floors_validated() -> None:
    with pytest.raises(ConfigError, match="outside"):
        validate_config({"promote": {"floors": {"main": 1.5}}})
    with pytest.raises(ConfigError, match="unknown suite"):
        validate_config({"promote": {"floors": {"nope": 0.1}}})
    cfg = validate_config({"eval": {"suites": [{"name": "train-split", "split": "train", "guard": False}]},
                           "promote": {"floors": {"main": 0.1, "train-split": 0.2}}})
    assert extra_suites_needed(cfg) == {"train-split"}  # a floor makes the gate evaluate a non-guard suite


@pytest.mark.parametrize("name", ["demo.yaml", "smollm2.yaml", "smollm2_arithmetic.yaml"])
def test_shipped_configs_have_a_main_floor_above_an_untrained_model(name: str) -> None:
    floor = load_config(ROOT / "configs" / name).promote.floors["main"]
    assert 0.0 < floor <= 0.1
    d = gate_rewards(_ids(), [0.0] * 40, None, load_config(ROOT / "configs" / name).promote)
    assert not d.promote


def test_floor_uses_the_candidate_mean() -> None:
    rng = random.Random(3)
    cand = [float(rng.random() < 0.5) for _ in range(100)]
    d1 = gate_rewards([f"f|{i}|0" for i in range(100)], cand, None, PromoteConfig(floors={"main": 0.9}))
    assert not d1.promote and d1.floors[0].score == pytest.approx(sum(cand) / 100)
