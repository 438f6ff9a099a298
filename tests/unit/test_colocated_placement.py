"""The colocated weight placement without a trainer group: config refusals, the rollout-service
adapter's answers, the prompt split and its per-row streams (a slice samples what the whole batch
does), and the utilisation accounting (generation is trainer busy time, no rollout worker resource)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import ConfigError, load_config
from infra.ops.cost import price_run, run_rates
from infra.ops.utilisation import account, closure
from infra.ops.utilisation_report import utilisation_markdown
from infra.rollout.colocated import ColocatedError, ColocatedRollout
from infra.rollout.placement import create_rollout_service
from infra.storage import open_store
from infra.train.colocated_ops import prompt_slice

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


@pytest.mark.parametrize("overrides, setting", [
    (["rollout.type=vllm"], "rollout.type='vllm'"),
    (["trainer.engine=fsdp"], "trainer.engine='fsdp'"),
    (["trainer.engine=deepspeed", "trainer.zero_stage=3"], "trainer.zero_stage=3"),
    (["trainer.lora.enabled=true"], "trainer.lora.enabled=true"),
    (["loop.mode=async"], "loop.mode='async'"),
])
def test_colocated_refuses_settings_it_cannot_run(overrides: list[str], setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["weight_sync.placement=colocated", *overrides])
    assert setting in str(err.value) and "weight_sync.placement=colocated" in str(err.value)
    load_config(DEMO, overrides)  # the same settings are fine with the separate placement


def test_colocated_accepts_the_demo_and_zero_1_2() -> None:
    assert load_config(DEMO, ["weight_sync.placement=colocated"]).weight_sync.placement == "colocated"
    load_config(DEMO, ["weight_sync.placement=colocated", "trainer.engine=deepspeed", "trainer.zero_stage=2"])


def test_adapter_has_no_endpoint_and_needs_a_trainer(tmp_path: Path) -> None:
    cfg = load_config(DEMO, ["weight_sync.placement=colocated", f"run_root={tmp_path}"])
    svc = create_rollout_service(cfg, "r1", open_store(f"file://{tmp_path}/store"), tmp_path)
    assert isinstance(svc, ColocatedRollout) and svc.restarts == 0
    svc.launch()
    svc.wait_ready()
    with pytest.raises(ColocatedError, match="no rollout worker, so no HTTP/OpenAI endpoint"):
        _ = svc.url
    with pytest.raises(ColocatedError, match="no trainer group is bound"):
        svc.load(1)
    assert not ColocatedError.retryable


class _Group:
    """A stand-in for the trainer group's control channel: holds a version, records the calls."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.calls: list[tuple[str, dict]] = []

    def call(self, op: str, **kw: object) -> dict:
        self.calls.append((op, kw))
        return {"version": self.version, "step": self.version - 1} if op == "colocated_version" else {"op": op}


def test_load_checks_the_version_the_trainer_holds(tmp_path: Path) -> None:
    cfg = load_config(DEMO, ["weight_sync.placement=colocated", f"run_root={tmp_path}"])
    svc = ColocatedRollout(cfg, "r1", open_store(f"file://{tmp_path}/store"), tmp_path)
    group = _Group(3)
    svc.bind_trainer(group)
    assert svc.load(3) == {"version": 3, "applied": True, "seconds": 0.0, "bytes": 0}
    assert svc.load(None)["version"] == 3 and svc.served == 3
    with pytest.raises(ColocatedError, match="cannot serve weight version 4: the trainer ranks hold version 3"):
        svc.load(4)
    svc.rollout("runs/r1/step-000001/prompts.json", "runs/r1/step-000001/rollouts.json", 4, 1.0, 16, seed=7)
    assert group.calls[-1] == ("colocated_rollout", {
        "prompts_key": "runs/r1/step-000001/prompts.json", "out_key": "runs/r1/step-000001/rollouts.json",
        "n": 4, "temperature": 1.0, "max_new_tokens": 16, "seed": 7, "version": 3})
    # a resumed run replaying stored batches syncs versions the restored trainer is past: acknowledged,
    # and the next rollout carries that version, which the ranks refuse until they hold it again
    assert svc.load(2)["version"] == 2
    svc.rollout("runs/r1/step-000002/prompts.json", "runs/r1/step-000002/rollouts.json", 4, 1.0, 16, seed=7)
    assert group.calls[-1][1]["version"] == 2


@pytest.mark.parametrize("total, world", [(64, 2), (7, 3), (2, 4), (1, 1)])
def test_prompt_slices_cover_the_batch_in_order(total: int, world: int) -> None:
    slices = [prompt_slice(total, r, world) for r in range(world)]
    assert slices[0][0] == 0 and slices[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    assert max(hi - lo for lo, hi in slices) - min(hi - lo for lo, hi in slices) <= 1


def test_a_slice_samples_what_the_whole_batch_does() -> None:
    pytest.importorskip("transformers")
    from infra.config import TinyModelConfig
    from infra.model import build_tiny_model, build_tokenizer
    from infra.rollout.engine import SamplingParams, encode_prompts
    from infra.rollout.local import LocalEngine

    tok = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                             max_position=256), tok, seed=0)
    ids = encode_prompts(tok, ["1,2,3,4,5,6=", "10,20,30=", "3=", "0,1,4,9=", "7,7,7=", "2,4="])
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop=["\n"], seed=5)
    whole = LocalEngine(model, tok).generate_ids(ids, 3, params)
    for world in (2, 3):
        parts = []
        for r in range(world):
            lo, hi = prompt_slice(len(ids), r, world)
            parts += LocalEngine(model, tok).generate_ids(ids[lo:hi], 3, params, first_prompt=lo)
        assert [(c.prompt_index, c.token_ids) for c in parts] == [(c.prompt_index, c.token_ids) for c in whole]


def _history() -> list[dict]:
    """Provision 0-20 (warm start 5-15), eval 20-30 (6 s generating), two steps, teardown 90-100."""
    return [
        {"kind": "phase", "phase": "warmstart", "t0": 5.0, "t1": 15.0},
        {"kind": "phase", "phase": "provision", "t0": 0.0, "t1": 20.0},
        {"kind": "phase", "phase": "eval", "t0": 20.0, "t1": 30.0, "generate_seconds": 6.0},
        {"kind": "step", "step": 1,
         "spans": {"rollout": [30.0, 35.0], "score": [35.0, 40.0], "train": [40.0, 48.0], "sync": [48.0, 49.0]}},
        {"kind": "step", "step": 2,
         "spans": {"rollout": [50.0, 55.0], "score": [55.0, 60.0], "train": [60.0, 68.0], "sync": [68.0, 69.0]}},
        {"kind": "phase", "phase": "teardown", "t0": 90.0, "t1": 100.0},
    ]


def test_colocated_generation_is_trainer_busy_and_no_rollout_resource() -> None:
    util = account(_history(), 0.0, 100.0, ranks=2, concurrency=2, min_warm=2, colocated=True)
    t, r = util["trainer"], util["rollout"]
    assert r["count"] == 0 and r["busy_seconds"] == 0 and r["idle_seconds_total"] == 0
    assert t["busy_by_kind"] == pytest.approx({"warmstart": 20.0, "eval_generate": 12.0, "generate": 20.0,
                                               "train": 32.0})
    assert t["busy_seconds"] + t["idle_seconds_total"] == pytest.approx(200.0)
    assert closure(util, 100.0)["relative_error"] == pytest.approx(0.0, abs=1e-12)
    cfg = load_config(DEMO, ["weight_sync.placement=colocated"])
    cost = price_run(util, run_rates(cfg))
    assert cost["by_resource"]["rollout"]["usd"] == 0.0 and cost["total_usd"] > 0
    md = utilisation_markdown({"wall_seconds": 100.0, "utilisation": util, "cost": cost})
    assert "| trainer | 2 |" in md and "| rollout | 0 | 0.0 |" in md
    separate = account(_history(), 0.0, 100.0, ranks=2, concurrency=2, min_warm=2)
    assert separate["rollout"]["count"] == 1 and "generate" not in separate["trainer"]["busy_by_kind"]


def test_one_rank_op_writes_the_workers_rollouts_object(tmp_path: Path) -> None:
    """The op on a single rank (no process group needed at world 1): the rollouts object has the
    rollout worker's fields, every sample the held version; another version is refused."""
    pytest.importorskip("transformers")
    from evals.registry import cached_environment
    from infra.model import load_policy
    from infra.stages.evaluate import prompt_batch
    from infra.storage import get_json, put_json
    from infra.train.colocated_ops import ColocatedOps, VersionMismatch

    cfg = load_config(DEMO, ["weight_sync.placement=colocated", "model.tiny.hidden_size=32", "model.tiny.num_layers=1",
                             "model.tiny.intermediate_size=64", "model.tiny.num_heads=2"])
    rank = ColocatedOps()
    model, tok = load_policy(cfg.model, seed=0)
    rank.cfg, rank.store, rank.run_id, rank.rank, rank.world = cfg, open_store(f"file://{tmp_path}"), "r1", 0, 1
    rank.model, rank.tokenizer, rank.weights_version, rank.step = model.train(), tok, 2, 1
    env = cached_environment(cfg.env)
    put_json(rank.store, "runs/r1/step-000001/prompts.json", prompt_batch(cfg.env, env, env.train_items(1, 3)))
    out = rank.op_colocated_rollout("runs/r1/step-000001/prompts.json", "runs/r1/step-000001/rollouts.json", 2, 1.0,
                                    8, seed=3, version=2)
    doc = get_json(rank.store, "runs/r1/step-000001/rollouts.json")
    assert {"version", "group_size", "prompts", "prompt_ids", "samples", "seconds", "tokens"} <= set(doc)
    assert out["samples"] == len(doc["samples"]) == 6 and doc["version"] == out["version"] == 2
    assert [s["prompt_index"] for s in doc["samples"]] == [0, 0, 1, 1, 2, 2]
    assert {s["version"] for s in doc["samples"]} == {2} and doc["ranks"][0]["prompts"] == [0, 3]
    assert model.training  # generation switched the module to eval and back
    with pytest.raises(VersionMismatch, match="asked for weights version 3; the trainer ranks hold version 2"):
        rank.op_colocated_rollout("runs/r1/step-000001/prompts.json", "runs/r1/step-000001/x.json", 2, 1.0, 8,
                                  seed=3, version=3)
    assert rank._colocated_publish()["bytes_written"] == 0 and rank.weights_version == 3


def test_bench_record_compares_placements_side_by_side() -> None:
    from bench.sync_colocated import record

    def run(steps: int, wall: float, gain: float) -> dict:
        return {"steps": steps, "step_wall_seconds": wall, "sync": [0.01] * steps, "publish_load": [0.2] * steps,
                "placement_stage_seconds": wall / 2, "step_seconds": [wall / steps] * steps,
                "gain": gain, "gain_ci95": [gain - 0.03, gain + 0.03], "eval_before": 0.25, "eval_after": 0.25 + gain,
                "wall_seconds": wall + 60}

    one = record(0, [run(200, 600.0, 0.15)], [run(200, 900.0, 0.14)], lr=2e-4)
    assert one["placement"] == "colocated" and one["readers"] == 0 and one["amortized_fraction"] == 0.0
    assert one["steps_per_min"] == pytest.approx(20.0) and one["separate_steps_per_min"] == pytest.approx(200 / 15)
    assert one["speedup"] == pytest.approx(1.5) and one["p50_seconds"] == pytest.approx(0.01)
    assert one["placement_stage_seconds_per_step"] == pytest.approx(1.5) and one["placement_stage_speedup"] == 1.5
    assert one["median_steps_per_min"] == pytest.approx(20.0)
    assert one["heldout_gain"] == 0.15 and one["separate_heldout_gain_ci95"] == pytest.approx([0.11, 0.17])
    both = record("all", [run(200, 600.0, 0.15), run(100, 200.0, 0.1)], [run(200, 900.0, 0.14), run(100, 300.0, 0.12)],
                  lr=2e-4)
    assert both["steps_per_min"] == pytest.approx(22.5) and both["heldout_gain"] == [0.15, 0.1]
    assert both["separate_heldout_gain_mean"] == pytest.approx(0.13)
