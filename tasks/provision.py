"""Task wrappers for *provision* and *teardown* (logic in :mod:`infra.stages.provision`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.stages import provision as logic
from infra.stages.context import Cluster, RunContext


@task(name="provision-cluster", cache_policy=NO_CACHE)
def provision(ctx: RunContext) -> Cluster:
    """Start trainer ranks, rollout worker and sandbox pool; publish version 1.

    Not retried: a half-started cluster is torn down inside and the error names the failing part.
    """
    return logic.provision(ctx)


@task(name="teardown", cache_policy=NO_CACHE)
def teardown(cluster: Cluster | None) -> list[str]:
    """Stop every service (also after a failure)."""
    return logic.teardown(cluster)
