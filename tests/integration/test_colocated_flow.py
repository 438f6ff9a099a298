"""The whole flow with ``weight_sync.placement: colocated`` on the tiny demo config: no rollout
worker, the trainer ranks generate every batch (split across the 2 ranks) with the weights version
they hold, nothing is published to the store, the run learns and finishes with the summary of a
separate-placement run, and the utilisation buckets still add up to wall x resources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.flow_helpers import reference, run_flow, run_id, step_doc

pytestmark = pytest.mark.slow
STEPS = 4


def _summary(proc_stdout: str, root: Path) -> dict:
    paths = list(root.glob("*/summary.json"))
    assert len(paths) == 1, (paths, proc_stdout[-2000:])
    return json.loads(paths[0].read_text())


def test_colocated_flow_generates_on_the_trainer_ranks(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path / "runs"
    proc = run_flow(root, "sync", "--set", "weight_sync.placement=colocated")
    assert "rollout on the trainer ranks (colocated)" in proc.stdout + proc.stderr
    s = _summary(proc.stdout, root)
    assert s["steps"] == STEPS and s["final_weight_version"] == STEPS + 1
    for step in range(1, STEPS + 1):
        roll = step_doc(root, step, "rollouts.json")
        assert roll is not None and roll["placement"] == "colocated"
        assert roll["version"] == step and {x["version"] for x in roll["samples"]} == {step}  # v1 before step 1
        ranks = roll["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["samples"] > 0 for r in ranks)  # split across ranks
        assert ranks[0]["prompts"][1] == ranks[1]["prompts"][0] == len(roll["prompts"]) // 2
        assert sum(r["samples"] for r in ranks) == len(roll["samples"]) == len(roll["prompts"]) * roll["group_size"]
        assert [x["prompt_index"] for x in roll["samples"]] == sorted(x["prompt_index"] for x in roll["samples"])
        assert all(len(x["logprobs"]) == len(x["token_ids"]) > 0 for x in roll["samples"])
        train = step_doc(root, step, "train.json")
        assert train is not None and train["rollout_version"] == step and train["publish"]["bytes_written"] == 0
    assert not (root / "store" / "runs" / run_id(root) / "weights").exists()  # no version was published
    assert s["sync_bytes_total"] == 0
    # the run learned something and finished like a separate-placement run, with the same summary keys
    assert any(h.get("loss") not in (None, 0.0) for h in s["history"] if h["kind"] == "step")
    separate = _summary("", reference(tmp_path_factory, "sync"))
    assert set(s) == set(separate)
    # utilisation: no rollout worker is held; generation is trainer busy time; the buckets add up
    util, wall = s["utilisation"], s["wall_seconds"]
    assert util["rollout"]["count"] == 0 and util["rollout"]["busy_seconds"] == 0
    assert util["trainer"]["busy_by_kind"]["generate"] > 0 and util["trainer"]["busy_by_kind"]["eval_generate"] > 0
    accounted = sum(r["busy_seconds"] + sum(r["idle_seconds"].values()) for r in util.values())
    expected = wall * sum(r["count"] for r in util.values())
    assert abs(accounted - expected) <= 0.02 * expected, (accounted, expected)
    assert s["cost"]["by_resource"]["rollout"]["usd"] == 0.0
