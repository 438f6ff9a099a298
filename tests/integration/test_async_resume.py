"""Async resume without loss (issue #16): a flow killed with its whole process tree and resumed with
``deltaloop run --resume`` trains exactly the batches an uninterrupted run trains.

Replays the fault "async runs that restart drop the rollouts they had buffered, so prompts are
skipped": with ``loop.mode: async`` the batch of step t+1 is generated and scored while step t
trains, so a crash leaves batches generated but not trained, or half generated. Each test stops the
real run at an exact point (``tests/integration/flowfaults``), SIGKILLs the CLI and every process
it started (trainer ranks, rollout worker, sandboxes, Prefect server), resumes, and checks per step
the prompt ids trained, the weight version that generated the batch and the digest of its samples
and scores (each step's ``train.json``), and bit-identical final weights and optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.flow_helpers import (assert_same_weights, final_weights, kill_tree, reference, run_flow, run_id,
                                start_paused, step_doc, trained)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def async_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The undisturbed async run; every step trained a batch one version behind."""
    root = reference(tmp_path_factory, "async")
    rec = trained(root)
    assert [r["rollout_version"] for r in rec] == [1, 1, 2, 3]
    assert all(len(r["prompt_ids"]) == 8 for r in rec)
    return root


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The undisturbed sync run; every step trained a batch of the newest version."""
    root = reference(tmp_path_factory, "sync")
    assert [r["rollout_version"] for r in trained(root)] == [1, 2, 3, 4]
    return root


def _kill_at(tmp_path: Path, mode: str, points: list[str]) -> tuple[Path, str]:
    """Run until ``points``, then SIGKILL the whole process tree. Returns the run root and run id."""
    root = tmp_path / "runs"
    proc, _ = start_paused(root, mode, points, tmp_path / "paused")
    kill_tree(proc, root)
    rid = run_id(root)
    assert not (root / rid / "summary.json").exists()
    return root, rid


def _resume(root: Path, mode: str, rid: str) -> str:
    """``deltaloop run --resume`` to the end; its stderr."""
    out = run_flow(root, mode, "--resume", rid)
    assert run_id(root) == rid and (root / rid / "summary.json").exists()
    return out.stderr


def _same_as(root: Path, ref: Path) -> None:
    assert trained(root) == trained(ref)
    assert_same_weights(final_weights(root), final_weights(ref))


def test_killed_while_next_batch_generates_during_training(async_reference: Path, tmp_path: Path) -> None:
    """Replays the flow killed (issue #16) while the rollout of step 3 is in flight and step 2
    trains: nothing of step 3 is stored; on resume step 2 is trained from its stored batch and
    step 3's batch is generated again from the same version with the same seeds."""
    root, rid = _kill_at(tmp_path, "async", ["train@2", "rollout@3"])
    assert step_doc(root, 2, "train.json") is None and step_doc(root, 3, "prompts.json") is not None
    assert step_doc(root, 3, "rollouts.json") is None
    _resume(root, "async", rid)
    _same_as(root, async_reference)


def test_killed_between_train_and_sync(async_reference: Path, tmp_path: Path) -> None:
    """Replays the flow killed (issue #16) after step 2 trained (version 3 published) and step 3's batch was generated from
    version 2, while the worker was told to load version 3: the stored, untrained batch of step 3
    is trained after resume as it was generated (not regenerated, not skipped)."""
    root, rid = _kill_at(tmp_path, "async", ["load@3"])
    assert step_doc(root, 2, "train.json") is not None and step_doc(root, 3, "train.json") is None
    buffered = step_doc(root, 3, "rollouts.json")
    assert buffered is not None and buffered["version"] == 2
    err = _resume(root, "async", rid)
    assert "stored batch of step 3" in err, err[-3000:]
    assert step_doc(root, 3, "rollouts.json") == buffered
    _same_as(root, async_reference)


def test_killed_right_after_a_step_record(async_reference: Path, tmp_path: Path) -> None:
    """Replays the flow killed (issue #16) right after it recorded step 2 (its metrics and progress line), with step 3's
    batch generated but not trained: resume trains it once, and the record of every step equals
    the uninterrupted run's."""
    root, rid = _kill_at(tmp_path, "async", ["record@2"])
    assert step_doc(root, 2, "train.json") is not None and step_doc(root, 3, "train.json") is None
    buffered = step_doc(root, 3, "rollouts.json")
    assert buffered is not None and buffered["version"] == 2
    _resume(root, "async", rid)
    assert step_doc(root, 3, "rollouts.json") == buffered
    _same_as(root, async_reference)


def test_sync_killed_while_a_batch_generates(sync_reference: Path, tmp_path: Path) -> None:
    """Replays the flow killed (issue #16) in sync mode while the rollout of step 3 is in flight (step 2 trained and synced): the
    resumed run generates step 3 from version 3 with the same seeds and trains what the
    uninterrupted run trained."""
    root, rid = _kill_at(tmp_path, "sync", ["rollout@3"])
    assert step_doc(root, 2, "train.json") is not None and step_doc(root, 3, "rollouts.json") is None
    _resume(root, "sync", rid)
    _same_as(root, sync_reference)
