"""Utilisation accounting (every resource-second in one bucket) and the cost arithmetic, on hand-made
histories whose buckets can be worked out by hand."""

from __future__ import annotations

import pytest

from infra.config import CostConfig, load_config
from infra.ops.cost import gpus_per_rank, price_run, run_rates, unit_rates
from infra.ops.timeline import plot_timeline
from infra.ops.utilisation_report import utilisation_markdown, utilisation_metrics, utilisation_record
from infra.ops.utilisation import account, closure, phase, sandbox_buckets, sweep, timed


def _history() -> list[dict]:
    """A sync run on the clock 0..100: provision 0-20 (warm start 5-15), eval 20-30 (6 s generating),
    two steps (rollout, score, train, sync), final eval 70-80, teardown 90-100."""
    pool = {"busy_sandbox_seconds": 8.0, "idle_sandbox_seconds": 30.0, "start_sandbox_seconds": 2.0,
            "acquire_wait_seconds": 4.0}
    return [
        {"kind": "phase", "phase": "warmstart", "t0": 5.0, "t1": 15.0},
        {"kind": "phase", "phase": "provision", "t0": 1.0, "t1": 20.0},
        {"kind": "phase", "phase": "eval", "t0": 20.0, "t1": 30.0, "generate_seconds": 6.0},
        {"kind": "eval", "step": 0, "score": 0.1},
        {"kind": "step", "step": 1, "sandbox_window": pool,
         "spans": {"rollout": [30.0, 35.0], "score": [35.0, 40.0], "train": [40.0, 48.0], "sync": [48.0, 49.0]}},
        {"kind": "step", "step": 2, "sandbox_window": pool,
         "spans": {"rollout": [50.0, 55.0], "score": [55.0, 60.0], "train": [60.0, 68.0], "sync": [68.0, 69.0]}},
        {"kind": "phase", "phase": "eval", "t0": 70.0, "t1": 80.0, "generate_seconds": 99.0},
        {"kind": "phase", "phase": "teardown", "t0": 90.0, "t1": 95.0, "sandbox_window": {**pool, "idle_sandbox_seconds": 2.0}},
    ]


def test_sweep_tiles_the_window_by_priority() -> None:
    seg = sweep(0.0, 10.0, [(2.0, 6.0, "low"), (4.0, 8.0, "high"), (-5.0, 1.0, "low"), (9.0, 20.0, "high")],
                ("high", "low"), "rest")
    assert seg == [(0.0, 1.0, "low"), (1.0, 2.0, "rest"), (2.0, 4.0, "low"), (4.0, 8.0, "high"),
                   (8.0, 9.0, "rest"), (9.0, 10.0, "high")]
    assert sum(b - a for a, b, _ in seg) == pytest.approx(10.0)
    assert sweep(5.0, 5.0, [(0.0, 9.0, "x")], ("x",), "rest") == []


def test_every_second_lands_in_one_bucket() -> None:
    util = account(_history(), 0.0, 100.0, ranks=2, concurrency=2, min_warm=1)
    tr, ro, orch, sb = util["trainer"], util["rollout"], util["orchestrator"], util["sandboxes"]
    # trainer (x2 ranks): warm start 10 + train 16 busy; start-up 0-20 less the warm start; evals 20; teardown 10;
    # the loop (30-70, 80-90) less training waits for rollouts
    assert tr["busy_by_kind"] == pytest.approx({"warmstart": 20.0, "train": 32.0})
    assert tr["idle_seconds"] == pytest.approx({"startup": 20.0, "evaluation": 40.0, "teardown": 20.0,
                                                "waiting_for_rollouts": 2 * (50.0 - 16.0)})
    # rollout: 10 generating + 2 loading, eval generation 6 + 10 (capped at the phase)
    assert ro["busy_by_kind"] == pytest.approx({"generate": 10.0, "load_weights": 2.0, "eval_generate": 16.0})
    assert ro["idle_seconds"]["evaluation"] == pytest.approx(4.0)
    assert ro["idle_seconds"]["waiting_for_weights"] == pytest.approx(50.0 - 12.0)
    # orchestrator: 4 slot-seconds of acquire wait over 2 slots = 2 s of each 5 s score stage
    assert orch["idle_seconds"]["scoring_queue_wait"] == pytest.approx(4.0)
    assert orch["busy_by_kind"]["scoring"] == pytest.approx(6.0)
    assert orch["idle_seconds"]["waiting_for_services"] == pytest.approx(28.0)
    assert orch["busy_by_kind"]["orchestration"] == pytest.approx(50.0 - 10.0 - 28.0)
    # sandboxes: 2 slots x 100 s; live = busy 24 + warm 62 + starting 6
    assert sb["count"] == 2 and sb["busy_seconds"] == pytest.approx(24.0)
    assert sb["idle_seconds"] == pytest.approx({"warm_no_job": 62.0, "startup": 6.0, "no_sandbox": 200.0 - 92.0})
    for name, r in util.items():
        assert r["busy_seconds"] + r["idle_seconds_total"] == pytest.approx(100.0 * r["count"]), name
    assert closure(util, 100.0)["relative_error"] < 1e-12


def test_async_overlap_counts_busy_once() -> None:
    """Train of step 1 overlapping the rollout of step 2: each lane counts its own work once."""
    hist = [{"kind": "step", "step": 1, "spans": {"train": [10.0, 20.0], "sync": [20.0, 21.0]}},
            {"kind": "step", "step": 2, "spans": {"rollout": [12.0, 19.0], "score": [19.0, 20.0]}}]
    util = account(hist, 0.0, 30.0, ranks=1, concurrency=1, min_warm=0)
    assert util["trainer"]["busy_seconds"] == pytest.approx(10.0)
    assert util["rollout"]["busy_by_kind"] == pytest.approx({"generate": 7.0, "load_weights": 1.0})
    # scoring (19-20) wins over waiting for the trainer; waiting covers 10-19 and 20-21
    assert util["orchestrator"]["busy_by_kind"]["scoring"] == pytest.approx(1.0)
    assert util["orchestrator"]["idle_seconds"]["waiting_for_services"] == pytest.approx(10.0)
    assert closure(util, 30.0)["relative_error"] < 1e-12


def test_sandbox_slots_grow_to_hold_every_live_second() -> None:
    r = sandbox_buckets([{"busy_sandbox_seconds": 30.0, "idle_sandbox_seconds": 25.0}], wall=10.0,
                        concurrency=2, min_warm=1)
    assert r["count"] == 6 and r["idle_seconds"]["no_sandbox"] == pytest.approx(5.0)
    assert r["busy_seconds"] + r["idle_seconds_total"] == pytest.approx(60.0)


def test_phase_records_on_error_and_timed_keeps_generation_seconds() -> None:
    hist: list[dict] = []
    with pytest.raises(RuntimeError):
        with phase(hist, "provision"):
            raise RuntimeError("boom")
    out = timed(hist, "eval", lambda: {"generate_seconds": 1.5, "suites": {"x": {"generate_seconds": 0.5}}}, step=3)
    assert out["generate_seconds"] == 1.5
    assert [h["phase"] for h in hist] == ["provision", "eval"]
    assert hist[1]["generate_seconds"] == 2.0 and hist[1]["step"] == 3 and hist[1]["t1"] >= hist[1]["t0"]


def test_cost_arithmetic() -> None:
    cost = CostConfig(cpu_core_hour=0.05, gpu_hour=2.0, sandbox_hour=0.1, orchestrator_cores=1.0)
    assert unit_rates(cost, rank_cores=2.0, rank_gpus=0, rollout_cores=1.0) == pytest.approx(
        {"trainer": 0.1, "rollout": 0.05, "sandboxes": 0.1, "orchestrator": 0.05})
    assert unit_rates(cost, 1.0, 1, 1.0)["rollout"] == pytest.approx(2.05)  # the worker gets a GPU with the ranks
    util = account(_history(), 0.0, 100.0, ranks=2, concurrency=2, min_warm=1)
    rates = {"trainer": 36.0, "rollout": 3.6, "sandboxes": 36.0, "orchestrator": 0.0}  # 1 cent/s per unit, ...
    priced = price_run(util, rates, gain=0.5)
    by = priced["by_resource"]
    assert by["trainer"]["usd"] == pytest.approx(200 * 0.01)
    assert by["trainer"]["idle_usd"] == pytest.approx((200 - 52) * 0.01)
    assert by["rollout"]["usd"] == pytest.approx(100 * 0.001)
    assert by["sandboxes"]["usd"] == pytest.approx(92 * 0.01)  # empty slots are not billed
    assert by["orchestrator"]["usd"] == 0.0
    assert priced["total_usd"] == pytest.approx(2.0 + 0.1 + 0.92)
    assert priced["gain_per_dollar"] == pytest.approx(0.5 / 3.02)
    assert price_run(util, {}, gain=0.5)["gain_per_dollar"] is None


def test_gpu_prices_follow_the_cluster() -> None:
    assert gpus_per_rank(CostConfig(), "gloo", "local", 0, 1) == 0
    assert gpus_per_rank(CostConfig(), "nccl", "local", 0, 1) == 1
    assert gpus_per_rank(CostConfig(), "nccl", "kubernetes", 8, 4) == 2
    assert gpus_per_rank(CostConfig(gpus_per_rank=4), "gloo", "local", 0, 1) == 4
    cfg = load_config("configs/demo.yaml", ["cluster.backend=nccl", "cost.gpu_hour=3", "cost.cpu_core_hour=0"])
    assert run_rates(cfg)["trainer"] == pytest.approx(3.0) and run_rates(cfg)["rollout"] == pytest.approx(3.0)


def test_breakdown_table_metrics_and_timeline(tmp_path) -> None:
    hist = _history()
    util = account(hist, 0.0, 100.0, ranks=2, concurrency=2, min_warm=1)
    util["sandboxes"]["concurrency"] = 2
    cost = price_run(util, unit_rates(CostConfig(), 1.0, 0, 1.0), gain=0.2)
    summary = {"run_id": "demo-x", "wall_seconds": 100.0, "steps": 2, "eval_before": 0.1, "eval_after": 0.3,
               "utilisation": util, "utilisation_window": [0.0, 100.0], "utilisation_closure": closure(util, 100.0),
               "cost_usd": cost["total_usd"], "cost": cost, "gain_per_dollar": cost["gain_per_dollar"], "history": hist}
    md = utilisation_markdown(utilisation_record(summary))
    assert "| trainer | 2 |" in md and "waiting_for_rollouts" in md and "warm_no_job" in md
    assert "per dollar" in md and "off by 0.000%" in md
    m = utilisation_metrics(summary)
    assert m["util_sandboxes_idle_warm_no_job_s"] == pytest.approx(62.0)
    assert m["cost_usd"] == pytest.approx(cost["total_usd"]) and "gain_per_dollar" in m
    png = plot_timeline(summary, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
