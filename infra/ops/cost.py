"""What a run cost: its utilisation (:mod:`infra.ops.utilisation`) times prices per resource-hour.

A resource is paid for the whole time it is held, busy or idle — that is what makes idle time
expensive — except the sandbox pool's empty slots (``no_sandbox``): sandboxes are billed per live
sandbox. Prices come from the ``cost`` config section (:class:`~infra.configs.cost.CostConfig`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from infra.configs.cost import CostConfig

if TYPE_CHECKING:
    from infra.config import RunConfig

UNBILLED_IDLE = {"sandboxes": ("no_sandbox",)}


def gpus_per_rank(cost: CostConfig, backend: str, cluster_type: str, k8s_gpus: int, k8s_procs: int) -> int:
    """GPUs a trainer rank holds: ``cost.gpus_per_rank``, else 1 on NCCL, the pod's GPUs per rank on
    Kubernetes, else 0 (gloo ranks run on CPU)."""
    if cost.gpus_per_rank is not None:
        return cost.gpus_per_rank
    if cluster_type == "kubernetes" and k8s_gpus:
        return max(1, k8s_gpus // max(1, k8s_procs))
    return 1 if backend == "nccl" else 0


def unit_rates(cost: CostConfig, rank_cores: float, rank_gpus: int, rollout_cores: float) -> dict[str, float]:
    """USD per hour of one unit of each resource (a rank, the worker, a sandbox, the orchestrator)."""
    rollout_gpus = cost.rollout_gpus if cost.rollout_gpus is not None else (1 if rank_gpus else 0)
    return {
        "trainer": rank_cores * cost.cpu_core_hour + rank_gpus * cost.gpu_hour,
        "rollout": rollout_cores * cost.cpu_core_hour + rollout_gpus * cost.gpu_hour,
        "sandboxes": cost.sandbox_hour,
        "orchestrator": cost.orchestrator_cores * cost.cpu_core_hour,
    }


def price_run(util: dict[str, Any], rates: dict[str, float], gain: float | None = None) -> dict[str, Any]:
    """Dollars per resource (total and the idle part) from resource-seconds and unit rates.

    ``gain``: the held-out score gain of the run; with it, ``gain_per_dollar`` (None when the run
    cost nothing)."""
    by: dict[str, dict[str, float]] = {}
    for name, r in util.items():
        unbilled = sum(r["idle_seconds"].get(c, 0.0) for c in UNBILLED_IDLE.get(name, ()))
        idle = r["idle_seconds_total"] - unbilled
        rate = rates.get(name, 0.0) / 3600.0
        by[name] = {"usd": (r["busy_seconds"] + idle) * rate, "idle_usd": idle * rate,
                    "usd_per_unit_hour": rates.get(name, 0.0)}
    total = sum(v["usd"] for v in by.values())
    out: dict[str, Any] = {"total_usd": total, "idle_usd": sum(v["idle_usd"] for v in by.values()),
                           "by_resource": by}
    if gain is not None:
        out["gain_per_dollar"] = gain / total if total > 0 else None
    return out


def run_rates(cfg: "RunConfig") -> dict[str, float]:
    """:func:`unit_rates` of a run config: cores per rank (``cluster.threads_per_rank``), GPUs per
    rank (:func:`gpus_per_rank`) and the rollout worker's cores (``rollout.threads``)."""
    c = cfg.cluster
    gpus = gpus_per_rank(cfg.cost, c.backend, c.type, c.kubernetes.gpus, c.kubernetes.procs_per_node)
    return unit_rates(cfg.cost, float(c.threads_per_rank), gpus, float(cfg.rollout.threads))
