"""``deltaloop report RUN_ID``: where the time and money of a past run went.

Reads the run's ``summary.json`` under ``run_root`` (from ``--config``/``--set``, as for ``run``),
else the ``utilisation.json`` of its MLflow run, and prints the utilisation and cost breakdown
(:mod:`infra.ops.utilisation_report`); ``--json`` prints the record itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deltaloop.cli_ops import CONFIG, SET, _cfg


def report(run_id: str = typer.Argument(..., help="Run id (the run folder's name under run_root)."),
           config: Path = CONFIG, set_: list[str] = SET,
           as_json: bool = typer.Option(False, "--json", help="Print the utilisation record as JSON.")) -> None:
    """Print busy and idle seconds per resource (idle by cause), the cost and the held-out gain per dollar."""
    from infra.ops.utilisation_report import find_record, utilisation_markdown

    cfg = _cfg(config, set_)
    rec = find_record(run_id, Path(cfg.run_root), cfg.resolved_tracking_uri())
    typer.echo(json.dumps(rec, indent=2) if as_json else utilisation_markdown(rec))


def register(app: typer.Typer) -> None:
    """Attach ``report``."""
    app.command("report")(report)
