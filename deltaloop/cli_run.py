"""``deltaloop run CONFIG`` and ``deltaloop validate CONFIG``."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Attach ``run`` and ``validate``."""

    @app.command("run")
    def run(
        config: Path = typer.Argument(Path("configs/demo.yaml"), help="Run config (YAML)."),
        set_: list[str] = typer.Option([], "--set", help="Override a field: --set trainer.steps=10 (repeatable)."),
    ) -> None:
        """Run the whole pipeline locally (Prefect's own server unless PREFECT_API_URL is set).

        Prints progress on stderr; the last line on stdout is the path of summary.json.
        """
        from infra.config import ConfigError, load_config

        try:
            load_config(config, set_)  # fail fast, before Prefect or torch is imported
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2)
        from flows.rl_train import rl_train

        result = rl_train(config=str(config), overrides=list(set_))
        typer.echo(result["summary_path"])

    @app.command("validate")
    def validate(
        config: Path = typer.Argument(..., help="Run config (YAML)."),
        set_: list[str] = typer.Option([], "--set", help="Override a field (repeatable)."),
    ) -> None:
        """Check a config without running anything; print the resolved config."""
        from infra.config import ConfigError, dump_config, load_config

        try:
            cfg = load_config(config, set_)
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2)
        typer.echo(dump_config(cfg))
