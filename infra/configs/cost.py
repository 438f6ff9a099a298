"""Config section ``cost``: prices per resource-hour, used to put a dollar figure on a run.

The run's utilisation accounting (:mod:`infra.ops.utilisation`) says how many seconds each
resource was held; :mod:`infra.ops.cost` multiplies them by these prices. The defaults are round
on-demand cloud list prices (a general-purpose vCPU at about $0.05 an hour, an H100-class GPU at
about $2.50 an hour); set your own provider's prices here or with ``--set cost.gpu_hour=...``.
"""

from __future__ import annotations

from pydantic import Field

from infra.configs.base import Strict


class CostConfig(Strict):
    """Prices per resource-hour (USD) and how many of each priced unit a resource holds."""

    cpu_core_hour: float = Field(
        0.048, ge=0, le=1000,
        description="USD per CPU core-hour: trainer ranks (cluster.threads_per_rank cores each), the rollout "
        "worker (rollout.threads cores) and the orchestrator (cost.orchestrator_cores).",
    )
    gpu_hour: float = Field(
        2.50, ge=0, le=10000, description="USD per GPU-hour, charged for every GPU a trainer rank or rollout worker holds.",
    )
    sandbox_hour: float = Field(
        0.048, ge=0, le=1000,
        description="USD per sandbox-hour of a live sandbox (starting, warm or running a job); empty pool slots cost nothing.",
    )
    orchestrator_cores: float = Field(1.0, ge=0, le=1024, description="CPU cores held by the flow process.")
    gpus_per_rank: int | None = Field(
        None, ge=0, le=64,
        description="GPUs per trainer rank (None: 1 when cluster.backend is 'nccl', kubernetes.gpus / procs_per_node "
        "on Kubernetes, else 0).",
    )
    rollout_gpus: int | None = Field(
        None, ge=0, le=64, description="GPUs of the rollout worker (None: 1 when the trainer ranks hold GPUs, else 0).",
    )
