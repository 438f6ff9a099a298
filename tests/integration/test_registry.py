"""MLflow tracking + registry against a real sqlite MLflow store: lineage tags, alias, rollback."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.registry import PREVIOUS_TAG, Registry
from infra.tracking import Tracker


def _logged_model(tracker: Tracker, tmp: Path, content: str) -> str:
    folder = tmp / f"model-{content}"
    folder.mkdir()
    (folder / "config.json").write_text('{"content": "%s"}' % content)
    tracker.log_artifacts(folder, "model")
    return tracker.run_id or ""


def test_register_alias_rollback_and_download(mlflow_uri: str, tmp_path: Path) -> None:
    tracker = Tracker(mlflow_uri, "exp", artifact_root=f"file://{tmp_path}/art")
    tracker.start("run-a")
    tracker.log_params({"trainer": {"lr": 0.1, "steps": 3}, "tags": ["x"]})
    tracker.log_metrics({"reward_mean": 0.5, "skip": None}, step=1)
    run_a = _logged_model(tracker, tmp_path, "a")
    tracker.end()
    reg = Registry(mlflow_uri, "policy")
    assert reg.alias("champion") is None
    v1 = reg.register(run_a, "model", {"eval_score": 0.4, "step": 3})
    assert reg.point("champion", v1.version) is None
    tracker.start("run-b")
    run_b = _logged_model(tracker, tmp_path, "b")
    v2 = reg.register(run_b, "model", {"eval_score": 0.6})
    assert reg.point("champion", v2.version) == v1.version
    champ = reg.alias("champion")
    assert champ is not None and champ.version == v2.version and champ.score() == pytest.approx(0.6)
    assert champ.tags[PREVIOUS_TAG] == v1.version
    path = reg.download("champion", tmp_path / "dl")
    assert "b" in (Path(path) / "config.json").read_text()
    frm, to = reg.rollback("champion")
    assert (frm, to) == (v2.version, v1.version)
    assert reg.alias("champion").version == v1.version  # type: ignore[union-attr]
    assert [v.version for v in reg.versions()] == [v2.version, v1.version]
    with pytest.raises(LookupError):
        reg.rollback("champion")  # v1 has no previous champion
