"""Staleness of training batches in asynchronous RL."""

from __future__ import annotations

from infra.stages.staleness import batch_staleness


def test_staleness_counts_versions_behind() -> None:
    assert batch_staleness(5, 5) == 0
    assert batch_staleness(6, 5) == 1
    assert batch_staleness(9, 5) == 4
    assert batch_staleness(5, 6) == 0  # a batch can never be ahead; clamp
