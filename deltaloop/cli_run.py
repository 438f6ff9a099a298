"""``deltaloop run CONFIG [--resume RUN_ID]`` and ``deltaloop validate CONFIG``."""

from __future__ import annotations

from pathlib import Path

import typer


def resume_config(run_root: Path, run_id: str) -> Path:
    """The config saved in the folder of run ``run_id``; :class:`ConfigError` if there is no such run."""
    from infra.config import ConfigError

    saved = run_root / run_id / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume {run_id}", [f"no run {run_id!r} under {run_root.resolve()} ({saved} is missing); "
                                                 "pass --set run_root=... if the run lives elsewhere"])
    return saved


def register(app: typer.Typer) -> None:
    """Attach ``run`` and ``validate``."""

    @app.command("run")
    def run(
        config: Path = typer.Argument(Path("configs/demo.yaml"), help="Run config (YAML)."),
        set_: list[str] = typer.Option([], "--set", help="Override a field: --set trainer.steps=10 (repeatable)."),
        resume: str | None = typer.Option(
            None, "--resume", metavar="RUN_ID",
            help="Continue run RUN_ID (under run_root) with the config saved in its folder; --set still applies "
            "on top (e.g. run_root to find it). Finished steps are read back; the trainer restores its last "
            "checkpoint.",
        ),
    ) -> None:
        """Run the whole pipeline locally (Prefect's own server unless PREFECT_API_URL is set).

        Prints progress on stderr; the last line on stdout is the path of summary.json. With a Prefect
        server (PREFECT_API_URL) the run first queues for cluster capacity (trainer-slots,
        rollout-slots) and says on stderr what it waits for (docs/operations.md, "Capacity").
        """
        from infra.config import ConfigError, load_config

        try:
            cfg = load_config(config, set_)  # fail fast, before Prefect or torch is imported
            if resume:
                config = resume_config(Path(cfg.run_root), resume)
                cfg = load_config(config, set_)
            from evals.registry import require_environments

            require_environments(cfg, str(config))  # a bad task, file or entry point: one line each, now
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2)
        from flows.rl_train import rl_train

        result = rl_train(config=str(config), overrides=list(set_), resume=resume)
        typer.echo(result["summary_path"])

    @app.command("validate")
    def validate(
        config: Path = typer.Argument(..., help="Run config (YAML)."),
        set_: list[str] = typer.Option([], "--set", help="Override a field (repeatable)."),
    ) -> None:
        """Check a config without running anything; print the resolved config."""
        from infra.config import ConfigError, dump_config, load_config

        from evals.registry import require_environments

        try:
            cfg = load_config(config, set_)
            require_environments(cfg, str(config))
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2)
        typer.echo(dump_config(cfg))
