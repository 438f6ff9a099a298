"""MLflow tracking: one MLflow run per deltaloop run.

Uses ``MlflowClient`` explicitly (no fluent global state), so tracking works from any thread and
several runs can be tracked by one process. The default store is a sqlite file under ``run_root``
with artifacts in ``<run_root>/mlartifacts``; any tracking URI (an MLflow server, Postgres...) works
through ``tracking.uri``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}`` (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


class Tracker:
    """Thin wrapper over ``MlflowClient`` bound to one run."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            exp_id = self.client.create_experiment(experiment, artifact_location=artifact_root)
        else:
            exp_id = exp.experiment_id
        self.experiment_id = exp_id
        self.run_id: str | None = None
        self._pending: list[Any] = []  # RunOperations of asynchronous metric writes

    def start(self, run_name: str, tags: dict[str, str] | None = None) -> str:
        """Create the MLflow run; returns its id."""
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags or {})
        self.run_id = run.info.run_id
        return self.run_id

    def attach(self, run_id: str) -> None:
        """Continue logging into an existing run (resume)."""
        self.run_id = run_id

    def _rid(self) -> str:
        if self.run_id is None:
            raise RuntimeError("tracker has no active run")
        return self.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        """Log parameters (flattened; values truncated to MLflow's limit)."""
        from mlflow.entities import Param

        flat = flatten(params)
        items = [Param(k, v[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self._rid(), params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float | int | None], step: int, synchronous: bool = True) -> None:
        """Log numeric metrics at ``step`` (None values are skipped).

        ``synchronous=False`` queues the write on MLflow's background logger so the RL loop does
        not wait on the tracking store; :meth:`end` flushes the queue.
        """
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, float(v), ts, step) for k, v in metrics.items() if isinstance(v, (int, float)) and v == v]
        if items:
            ops = self.client.log_batch(self._rid(), metrics=items, synchronous=synchronous)
            if ops is not None:
                self._pending.append(ops)

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Set run tags."""
        for k, v in tags.items():
            self.client.set_tag(self._rid(), k, str(v))

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as an artifact file."""
        self.client.log_text(self._rid(), text, artifact_file)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        """Store a JSON artifact."""
        self.client.log_text(self._rid(), json.dumps(obj, indent=2, default=str), artifact_file)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a local file."""
        self.client.log_artifact(self._rid(), str(path), artifact_path)

    def log_artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        """Upload a local folder."""
        self.client.log_artifacts(self._rid(), str(folder), artifact_path)

    def log_figure(self, fig: Any, artifact_file: str) -> None:
        """Store a matplotlib figure as PNG."""
        with tempfile.TemporaryDirectory() as tmp:
            p = Path(tmp) / Path(artifact_file).name
            fig.savefig(p, dpi=110, bbox_inches="tight")
            parent = str(Path(artifact_file).parent)
            self.client.log_artifact(self._rid(), str(p), None if parent == "." else parent)

    def end(self, status: str = "FINISHED") -> None:
        """Close the run with ``status`` (FINISHED, FAILED, KILLED)."""
        self.flush()
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=status)

    def flush(self) -> None:
        """Wait until every queued asynchronous write reached the tracking store."""
        pending, self._pending = self._pending, []
        for ops in pending:
            ops.wait()

    def artifact_uri(self) -> str:
        """Root artifact URI of the run."""
        return self.client.get_run(self._rid()).info.artifact_uri
