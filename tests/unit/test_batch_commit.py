"""A step's stored batch (prompts, rollouts, then scores as the commit) across crashes (issue #16):
what a dropped or lost batch leaves behind can never be trained as another batch's, batches left
untrained are found on resume, and each step's training record names what it trained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.config import RunConfig
from infra.stages.context import Cluster, RunContext
from infra.stages.staleness import enforce_staleness, untrained_batches
from infra.stages.steps import rollout_batch
from infra.storage import ObjectStore, get_json, open_store, put_json


class CrashAfterDeletes:
    """The run's file store, with the process dying (an exception) after ``n`` deletes."""

    def __init__(self, store: ObjectStore, n: int) -> None:
        self.store, self.left = store, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def delete(self, key: str) -> None:
        if self.left == 0:
            raise SystemExit("killed")
        self.left -= 1
        self.store.delete(key)


class Worker:
    """Stands in for the rollout worker: writes a batch of one sample per prompt at ``version``."""

    def __init__(self, store: ObjectStore, version: int) -> None:
        self.store, self.version, self.restarts, self.calls = store, version, 0, 0

    def rollout(self, prompts_key: str, out_key: str, n: int, temperature: float, max_new_tokens: int,
                seed: int) -> dict[str, Any]:
        self.calls += 1
        prompts = get_json(self.store, prompts_key)["prompts"]
        samples = [{"prompt_index": i, "text": "x", "token_ids": [5, i], "logprobs": [0.0, 0.0],
                    "version": self.version} for i in range(len(prompts))]
        put_json(self.store, out_key, {"version": self.version, "group_size": 1, "prompts": prompts,
                                       "samples": samples})
        return {"key": out_key, "version": self.version, "samples": len(samples), "tokens": 2 * len(samples),
                "seconds": 0.0}


def _ctx(tmp_path: Path, **loop: Any) -> RunContext:
    cfg = RunConfig.model_validate({"trainer": {"prompts_per_step": 3, "group_size": 2}, "loop": loop})
    return RunContext(cfg, "run1", tmp_path / "run", open_store(str(tmp_path / "store")), tracker=None,
                      report=lambda _msg: None)


def _stored(ctx: RunContext, step: int) -> set[str]:
    return {n for n in ("prompts.json", "rollouts.json", "scores.json") if ctx.store.exists(ctx.key(step, n))}


def test_a_crash_while_dropping_a_stale_batch_never_leaves_its_scores(tmp_path: Path) -> None:
    """Replays the fault "flow killed while a stale batch is dropped": the drop deleted the
    rollouts, then the process died before the scores went, so the next batch generated for the
    step would have been trained with the old batch's scores. The scores (the batch's commit) are
    deleted first: a crash after one delete leaves an uncommitted batch, which is regenerated."""
    ctx = _ctx(tmp_path, mode="async", max_staleness=0, stale_policy="drop")
    cluster = Cluster(trainer=None, rollout=Worker(ctx.store, version=1), sandbox=None, version=3)
    roll = rollout_batch(ctx, cluster, 2)
    put_json(ctx.store, ctx.key(2, "scores.json"), {"rewards": [1.0, 0.0, 1.0]})
    ctx.store = CrashAfterDeletes(ctx.store, 1)  # type: ignore[assignment]
    with pytest.raises(SystemExit):
        enforce_staleness(ctx, cluster, 2, roll, {}, regenerate=lambda: pytest.fail("crashed before"))
    assert _stored(ctx, 2) == {"prompts.json", "rollouts.json"}


def test_scores_left_without_their_rollouts_are_not_kept_for_a_new_batch(tmp_path: Path) -> None:
    """Replays the state such a crash left before (scores stored, rollouts gone): generating the
    step's batch again first deletes the orphaned scores, so scoring runs on the new samples."""
    ctx = _ctx(tmp_path)
    worker = Worker(ctx.store, version=4)
    cluster = Cluster(trainer=None, rollout=worker, sandbox=None, version=4)
    put_json(ctx.store, ctx.key(5, "scores.json"), {"rewards": [1.0, 1.0, 1.0]})
    roll = rollout_batch(ctx, cluster, 5)
    assert roll["version"] == 4 and worker.calls == 1
    assert _stored(ctx, 5) == {"prompts.json", "rollouts.json"}
    again = rollout_batch(ctx, cluster, 5)  # a stored batch is returned as it is, never generated twice
    assert again["cached"] and again["version"] == 4 and worker.calls == 1


def test_untrained_batches_are_the_ones_a_crash_left(tmp_path: Path) -> None:
    """Steps with rollouts but no training record, oldest first, with their version and whether
    they were scored; trained steps and steps with prompts only are not listed."""
    ctx = _ctx(tmp_path)
    cluster = Cluster(trainer=None, rollout=Worker(ctx.store, version=2), sandbox=None)
    assert untrained_batches(ctx) == []
    for step in (1, 2, 3):
        rollout_batch(ctx, cluster, step)
    put_json(ctx.store, ctx.key(1, "scores.json"), {"rewards": [0.0] * 3})
    put_json(ctx.store, ctx.key(1, "train.json"), {"step": 1})
    put_json(ctx.store, ctx.key(2, "scores.json"), {"rewards": [0.0] * 3})
    put_json(ctx.store, ctx.key(4, "prompts.json"), {"prompts": ["a"]})
    assert untrained_batches(ctx) == [{"step": 2, "version": 2, "scored": True},
                                      {"step": 3, "version": 2, "scored": False}]


def test_training_record_names_prompts_version_and_samples() -> None:
    """The record of a step: the items' ids in batch order, the generating version, and a digest
    that changes with any sample's tokens, any reward or the mask."""
    pytest.importorskip("torch")
    from infra.train.worker import batch_record

    rollouts = {"version": 7, "samples": [{"prompt_index": 0, "token_ids": [1, 2]},
                                          {"prompt_index": 1, "token_ids": [3]}]}
    scores = {"rewards": [1.0, 0.0]}
    prompts = {"items": [{"id": "p-9"}, {"id": "p-3"}]}
    rec = batch_record(rollouts, scores, prompts)
    assert rec["prompt_ids"] == ["p-9", "p-3"] and rec["rollout_version"] == 7
    assert batch_record(rollouts, scores, None)["prompt_ids"] is None
    assert batch_record(rollouts, dict(scores), prompts)["batch_sha256"] == rec["batch_sha256"]
    other_tokens = {**rollouts, "samples": [rollouts["samples"][0], {"prompt_index": 1, "token_ids": [4]}]}
    for changed in (batch_record(other_tokens, scores, prompts), batch_record(rollouts, {"rewards": [1.0, 1.0]}, prompts),
                    batch_record(rollouts, {**scores, "masked": [False, True]}, prompts)):
        assert changed["batch_sha256"] != rec["batch_sha256"]
