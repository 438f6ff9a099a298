"""The run's closing lines say how the weight versions travelled: deltas through the object store
(and by how many trainer ranks each was published), whole models over the broadcast group, or
nothing (colocated)."""

from __future__ import annotations

from typing import Any

import pytest

from infra.stages.summary import human_summary


def _summary(placement: str | None) -> dict[str, Any]:
    s: dict[str, Any] = {
        "run_id": "r", "wall_seconds": 12.0, "steps": 3, "eval_before": 0.1, "eval_after": 0.2,
        "eval_gain_ci95": [0.05, 0.15], "eval_accuracy_before": 0.1, "eval_accuracy_after": 0.2, "eval_n": 10,
        "final_weight_version": 4, "sync_bytes_total": 6_000_000, "sync_fraction_mean": 0.5,
        "model_version": None, "promoted": False, "gate_reason": "promotion disabled",
        "mlflow_run_id": "m", "tracking_uri": "sqlite:///x.db",
    }
    if placement is not None:
        s["weight_placement"] = placement
    return s


@pytest.mark.parametrize(("placement", "said"), [
    ("object_store", "synced 6.00 MB in deltas (50.00% of full on average)"),
    (None, "synced 6.00 MB in deltas"),  # a summary without the field: the default placement
    ("broadcast", "synced 6.00 MB as whole models over the broadcast group (50.00%"),
    ("colocated", "(colocated: nothing moves)"),
])
def test_the_sync_line_names_how_versions_travelled(placement: str | None, said: str) -> None:
    text = human_summary(_summary(placement))
    assert said in text
    assert ("in deltas" in text) == (placement in (None, "object_store"))
    assert "published by" not in text


def test_the_sync_line_names_the_publishing_ranks_of_a_sharded_publish() -> None:
    s = {**_summary("object_store"), "publish_ranks": 4}
    assert "synced 6.00 MB in deltas (50.00% of full on average, each published by 4 trainer ranks)" in human_summary(s)
