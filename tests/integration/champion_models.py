"""Registered policies for the champion tests: tiny models with different seeds, each exported,
saved in MLflow's transformers flavour (:func:`infra.registry.save_mlflow_model`) and registered
the way *promote* does it, in a real sqlite MLflow store. Nothing is trained."""

from __future__ import annotations

from pathlib import Path

from infra.config import ModelConfig
from infra.model import load_policy, save_hf
from infra.registry import Registry, save_mlflow_model
from infra.tracking import Tracker


def register_policies(uri: str, root: Path, name: str = "deltaloop-policy", seeds: tuple[int, ...] = (0, 1),
                      experiment: str = "deltaloop") -> list[str]:
    """Register one tiny policy per seed; returns the version numbers."""
    tracker = Tracker(uri, experiment, artifact_root=f"file://{root}/mlartifacts")
    reg = Registry(uri, name)
    versions = []
    for seed in seeds:
        model, tok = load_policy(ModelConfig(), seed=seed)
        hf = save_hf(model, tok, root / f"export-{seed}")
        tracker.start(f"policy-seed-{seed}")
        tracker.log_artifacts(save_mlflow_model(hf, root / f"mlflow-{seed}", f"seed {seed}"), "model")
        versions.append(reg.register(tracker.run_id or "", "model", {"seed": seed}).version)
        tracker.end()
    return versions
