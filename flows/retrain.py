"""The ``retrain`` flow (scheduled): continue training from the current champion, then gate.

It resolves the champion to a pinned version and runs ``rl-train`` as a subflow with
``init_from`` set, so the usual promotion gate decides whether the retrained model replaces it.
That subflow queues for cluster capacity like any training run, behind waiting eval-gate runs
(:mod:`flows.capacity`).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows.guard import check_deployment_request
from flows.rl_train import rl_train
from infra.ops.retrain import retrain_overrides


@flow(name="retrain", log_prints=False)
def retrain(config: str = "configs/demo.yaml", overrides: list[str] | None = None,
            allow_scratch: bool = True) -> dict[str, Any]:
    """Retrain CONFIG from the champion (or from the base model if none and ``allow_scratch``).

    The request is checked here (``flows/guard.py``); ``rl-train`` then runs as a subflow with the
    checked overrides plus the ``init_from`` this flow adds."""
    check_deployment_request(config, overrides)
    ov, note = retrain_overrides(config, list(overrides or []), allow_scratch)
    get_run_logger().info(note)
    return rl_train(config=config, overrides=ov)
