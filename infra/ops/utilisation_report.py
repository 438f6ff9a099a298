"""The utilisation and cost breakdown of a run, as people and MLflow read it.

Built from a run's summary (``summary.json``, :func:`infra.stages.summary.build_summary`): a
markdown table (the Prefect artifact and ``deltaloop report RUN_ID``), flat MLflow metrics and the
JSON record logged as ``utilisation.json``. :func:`find_record` finds the record of any past run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from infra.errors import DeltaloopError

RECORD_KEYS = ("run_id", "wall_seconds", "steps", "eval_before", "eval_after", "utilisation", "utilisation_window",
               "utilisation_closure", "cost_usd", "cost", "gain_per_dollar")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class RunNotFound(DeltaloopError):
    """No run with this id: neither a run folder with a summary nor an MLflow run tagged with it."""


def utilisation_record(summary: dict[str, Any]) -> dict[str, Any]:
    """The part of a summary that ``utilisation.json`` and ``deltaloop report`` hold."""
    return {k: summary[k] for k in RECORD_KEYS if k in summary}


def utilisation_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """Flat MLflow metrics: ``util_<resource>_busy_s``, ``util_<resource>_idle_<cause>_s``,
    ``util_<resource>_busy_fraction``, ``cost_usd``, ``cost_idle_usd``, ``cost_<resource>_usd``,
    ``gain_per_dollar``."""
    out: dict[str, float] = {}
    for name, r in summary["utilisation"].items():
        out[f"util_{name}_busy_s"] = r["busy_seconds"]
        out[f"util_{name}_busy_fraction"] = r["busy_fraction"]
        for cause, sec in r["idle_seconds"].items():
            out[f"util_{name}_idle_{cause}_s"] = sec
    cost = summary["cost"]
    out["cost_usd"] = cost["total_usd"]
    out["cost_idle_usd"] = cost["idle_usd"]
    for name, c in cost["by_resource"].items():
        out[f"cost_{name}_usd"] = c["usd"]
    if cost.get("gain_per_dollar") is not None:
        out["gain_per_dollar"] = cost["gain_per_dollar"]
    return out


def _causes(seconds: dict[str, float], total: float) -> str:
    parts = [f"{c} {s:.1f}s ({100 * s / total:.0f}%)" for c, s in sorted(seconds.items(), key=lambda kv: -kv[1])
             if s > 0]
    return ", ".join(parts) or "–"


def utilisation_markdown(rec: dict[str, Any]) -> str:
    """A markdown section: headline (cost, gain per dollar), one row per resource, the closure check."""
    wall = float(rec["wall_seconds"])
    gain = (rec.get("eval_after") or 0.0) - (rec.get("eval_before") or 0.0)
    gpd = rec.get("gain_per_dollar")
    cost = rec["cost"]
    lines = [
        f"## Utilisation and cost — run `{rec.get('run_id', '?')}`",
        "",
        f"- wall {wall:.1f} s; cost **${cost['total_usd']:.4f}** of which idle ${cost['idle_usd']:.4f}",
        f"- held-out gain {gain:+.4f} → **{'n/a' if gpd is None else f'{gpd:+.3f}'} per dollar**",
        "",
        "| resource | count | busy s | busy | idle by cause (resource-seconds) | $/unit-hour | cost $ | idle $ |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, r in rec["utilisation"].items():
        c = cost["by_resource"].get(name, {})
        total = r["busy_seconds"] + r["idle_seconds_total"]
        lines.append(f"| {name} | {r['count']} | {r['busy_seconds']:.1f} | {100 * r['busy_fraction']:.1f}% | "
                     f"{_causes(r['idle_seconds'], total)} | {c.get('usd_per_unit_hour', 0):.4f} | "
                     f"{c.get('usd', 0):.5f} | {c.get('idle_usd', 0):.5f} |")
    cl = rec.get("utilisation_closure")
    if cl:
        lines += ["", f"Accounted {cl['accounted_seconds']:.1f} of {cl['expected_seconds']:.1f} resource-seconds "
                      f"(wall × resources; off by {100 * cl['relative_error']:.3f}%)."]
    busy = {n: r.get("busy_by_kind") or {} for n, r in rec["utilisation"].items()}
    lines += ["", "Busy by kind: " + "; ".join(
        f"{n}: " + ", ".join(f"{k} {v:.1f}s" for k, v in kinds.items()) for n, kinds in busy.items() if kinds), ""]
    return "\n".join(lines)


def find_record(run_id: str, run_root: Path, tracking_uri: str | None = None) -> dict[str, Any]:
    """The utilisation record of run ``run_id``: from ``<run_root>/<run_id>/summary.json``, else from
    the ``utilisation.json`` artifact of the MLflow run tagged ``deltaloop.run_id`` in ``tracking_uri``.

    Raises :class:`RunNotFound` when neither exists, or the run has no utilisation record."""
    if not _RUN_ID.match(run_id) or ".." in run_id:
        raise RunNotFound(f"{run_id!r} is not a run id (letters, digits, '_', '.', '-')")
    path = run_root / run_id / "summary.json"
    if path.is_file():
        summary = json.loads(path.read_text(encoding="utf-8"))
        if "utilisation" not in summary:
            raise RunNotFound(f"run {run_id} ({path}) has no utilisation record in its summary")
        return utilisation_record(summary)
    rec = _from_mlflow(run_id, tracking_uri) if tracking_uri and _store_exists(tracking_uri) else None
    if rec is None:
        where = f"{run_root.resolve()}" + (f" or in MLflow at {tracking_uri}" if tracking_uri else "")
        raise RunNotFound(f"no finished run {run_id!r} under {where} (no {path.name} in {path.parent}); "
                          "pass --set run_root=... if the run lives elsewhere")
    return rec


def _store_exists(tracking_uri: str) -> bool:
    """False for a sqlite tracking store whose file does not exist (reading must not create it)."""
    prefix = "sqlite:///"
    return not tracking_uri.startswith(prefix) or Path(tracking_uri[len(prefix):]).is_file()


def _from_mlflow(run_id: str, tracking_uri: str) -> dict[str, Any] | None:
    """The ``utilisation.json`` of the MLflow run tagged ``deltaloop.run_id = run_id``, if any."""
    import tempfile

    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(exps, filter_string=f"tags.`deltaloop.run_id` = '{run_id}'", max_results=1) if exps else []
    if not runs:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = client.download_artifacts(runs[0].info.run_id, "utilisation.json", tmp)
        except (MlflowException, OSError):  # a run that ended before its summary (failed or killed)
            return None
        return json.loads(Path(local).read_text(encoding="utf-8"))
