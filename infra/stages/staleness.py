"""Staleness control for asynchronous RL.

A training batch's *staleness* is how many versions the trainer's policy is ahead of the policy
that generated the batch (0 when synchronous). With ``loop.mode: async`` the batch for step t+1 is
generated while step t trains, so it is normally one version behind. A batch beyond
``loop.max_staleness`` is either dropped and regenerated from the current policy (``drop``) or kept
(``importance``): GRPO's clipped importance ratio against the log-probs recorded at generation time
already corrects for the policy that produced it.

A step's batch is stored as ``prompts.json`` (the items), ``rollouts.json`` (the samples, one object
written whole) and ``scores.json`` (written last: a batch is trainable once it exists). A dropped
batch loses its scores first, then its rollouts, so a crash in between never leaves scores that a
new batch could be mistaken for. Batches generated but not yet trained when the flow dies — in
async mode, the one of step t+1 while step t trains — stay in the store; ``deltaloop run --resume``
trains them as they were generated (:func:`untrained_batches` lists them), so no prompt is skipped
or trained twice.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from infra.stages.context import Cluster, RunContext
from infra.storage import get_json


def batch_staleness(trainer_version: int, batch_version: int) -> int:
    """Versions by which the trainer's policy is ahead of the batch's."""
    return max(0, trainer_version - batch_version)


def enforce_staleness(
    ctx: RunContext,
    cluster: Cluster,
    step: int,
    roll: dict[str, Any],
    score: dict[str, Any],
    regenerate: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Check the batch of ``step`` against the bound; returns (roll, score, staleness info).

    ``regenerate`` re-runs rollout and scoring for the step after its stale outputs are deleted.
    """
    lcfg = ctx.cfg.loop
    trainer_version = cluster.version
    stale = batch_staleness(trainer_version, int(roll["version"]))
    info = {"staleness": stale, "dropped": False, "bound": lcfg.max_staleness}
    if stale > lcfg.max_staleness and lcfg.stale_policy == "drop":
        for name in ("scores.json", "rollouts.json"):  # the commit (scores) goes first
            ctx.store.delete(ctx.key(step, name))
        ctx.report(f"step {step}: batch from v{roll['version']} is {stale} versions stale "
                   f"(bound {lcfg.max_staleness}); regenerating from v{trainer_version}")
        roll, score = regenerate()
        info = {"staleness": batch_staleness(trainer_version, int(roll["version"])), "dropped": True,
                "bound": lcfg.max_staleness}
    return roll, score, info


def untrained_batches(ctx: RunContext) -> list[dict[str, Any]]:
    """Batches of this run in the store that no step has trained yet, oldest first:
    ``[{"step", "version", "scored"}]`` (``version``: the weights that generated it; ``scored``:
    its scores are stored too). Empty for a new run; on ``--resume``, what the crash left buffered."""
    found: dict[int, set[str]] = {}
    for key in ctx.store.list(ctx.key(None, "step-")):
        m = re.search(r"/step-(\d+)/(rollouts|scores|train)\.json$", key)
        if m:
            found.setdefault(int(m.group(1)), set()).add(m.group(2))
    return [{"step": step, "version": int(get_json(ctx.store, ctx.key(step, "rollouts.json"))["version"]),
             "scored": "scores" in names}
            for step, names in sorted(found.items()) if "rollouts" in names and "train" not in names]
