"""Staleness control for asynchronous RL.

A training batch's *staleness* is how many versions the trainer's policy is ahead of the policy
that generated the batch (0 when synchronous). With ``loop.mode: async`` the batch for step t+1 is
generated while step t trains, so it is normally one version behind. A batch beyond
``loop.max_staleness`` is either dropped and regenerated from the current policy (``drop``) or kept
(``importance``): GRPO's clipped importance ratio against the log-probs recorded at generation time
already corrects for the policy that produced it.
"""

from __future__ import annotations

from typing import Any, Callable

from infra.stages.context import Cluster, RunContext


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
        for name in ("rollouts.json", "scores.json"):
            ctx.store.delete(ctx.key(step, name))
        ctx.report(f"step {step}: batch from v{roll['version']} is {stale} versions stale "
                   f"(bound {lcfg.max_staleness}); regenerating from v{trainer_version}")
        roll, score = regenerate()
        info = {"staleness": batch_staleness(trainer_version, int(roll["version"])), "dropped": True,
                "bound": lcfg.max_staleness}
    return roll, score, info
