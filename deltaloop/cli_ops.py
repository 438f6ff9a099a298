"""Operations commands: ``serve``, ``gate``, ``promote``, ``rollback``, ``champion``.

``serve`` runs the stack of :mod:`infra.serve`; the registry commands act on the registered model
and tracking store named by a run config (``--config``/``--set``, as for ``run``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from infra.config import RunConfig


def _cfg(config: Path, set_: list[str]) -> "RunConfig":
    """The run config, or exit 2 with the config's problems."""
    from infra.config import ConfigError, load_config

    try:
        return load_config(config, set_)
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)


CONFIG = typer.Option(Path("configs/demo.yaml"), "--config", "-c", help="Run config naming the tracking store.")
SET = typer.Option([], "--set", help="Override a config field (repeatable), e.g. --set run_root=/srv/runs.")


def serve(
    host: str = typer.Option("127.0.0.1", help="Interface for both servers (loopback by default)."),
    prefect_port: int = typer.Option(4200, help="Prefect API/UI port (0 = any free port)."),
    mlflow_port: int = typer.Option(5000, help="MLflow UI/registry port (0 = any free port)."),
    run_root: Path = typer.Option(Path("runs"), help="run_root of the served runs (MLflow sqlite + artifacts)."),
    prefect_db: str = typer.Option("", help="Prefect database URL (default: sqlite under PREFECT_HOME)."),
    mlflow_backend: str = typer.Option("", help="MLflow backend store URI, e.g. postgresql://u:p@host/db."),
    mlflow_artifacts: str = typer.Option("", help="MLflow artifact root, e.g. s3://bucket/mlflow."),
    worker_limit: int = typer.Option(4, min=1, help="Flow runs the worker admits at once (more than the "
                                     "cluster capacity, so runs queue visibly on the capacity limits)."),
    no_worker: bool = typer.Option(False, "--no-worker", help="Do not start a worker."),
    no_deploy: bool = typer.Option(False, "--no-deploy", help="Do not deploy prefect.yaml."),
    auth_file: Path | None = typer.Option(None, "--auth-file", help="File holding 'user:password' (mode 600) for the "
                                   "Prefect API and MLflow; default: $PREFECT_SERVER_API_AUTH_STRING."),
    champion: bool = typer.Option(False, "--champion", help="Also serve MODEL@ALIAS over an OpenAI-compatible "
                                  "endpoint that follows the alias (promote, rollback) without a restart."),
    champion_port: int = typer.Option(8000, help="Champion endpoint port (0 = any free port)."),
    champion_model: str = typer.Option("deltaloop-policy", help="Registered model to serve "
                                       "(tracking.registered_model)."),
    champion_alias: str = typer.Option("champion", help="Alias to follow."),
    champion_engine: str = typer.Option("local", help="local (torch, CPU or one GPU) or vllm (vLLM's server, GPUs)."),
    champion_poll: float = typer.Option(2.0, min=0.1, help="Seconds between reads of the alias."),
) -> None:
    """Start Prefect server + worker + MLflow server (+ the champion endpoint with --champion), deploy
    prefect.yaml, print URLs; Ctrl-C stops all.

    The auth string comes from a file or the environment, never from the command line (``ps`` shows
    argv to every user); without one, only loopback addresses are served."""
    from infra.rollout.vllm_env import vllm_python
    from infra.serve import ServeError, ServeOptions, read_auth, serve_forever

    try:
        auth = read_auth(auth_file)
        opts = ServeOptions(host=host, prefect_port=prefect_port, mlflow_port=mlflow_port, run_root=run_root,
                            prefect_db=prefect_db or None, mlflow_backend=mlflow_backend or None,
                            mlflow_artifacts=mlflow_artifacts or None, worker=not no_worker,
                            deploy=not no_deploy, worker_limit=worker_limit, api_auth_string=auth,
                            champion=champion, champion_port=champion_port, champion_model=champion_model,
                            champion_alias=champion_alias, champion_engine=champion_engine,
                            champion_poll_s=champion_poll,
                            champion_python=vllm_python() if champion_engine == "vllm" else None)
        code = serve_forever(opts, say=lambda m: typer.echo(m, err=True))
    except ServeError as exc:
        typer.echo(f"serve: {exc}", err=True)
        raise typer.Exit(1)
    raise typer.Exit(code)


def gate(version: str = typer.Argument(..., help="Registered model version to gate."),
         config: Path = CONFIG, set_: list[str] = SET) -> None:
    """Evaluate VERSION against the champion on the same suites; promote only if the gate passes."""
    cfg = _cfg(config, set_)
    from mlflow.exceptions import MlflowException

    from infra.registry import Registry

    try:  # a clear error before a flow run is created for a version that does not exist
        Registry(cfg.resolved_tracking_uri(), cfg.tracking.registered_model).get(version)
    except MlflowException as exc:
        typer.echo(f"gate: {exc.message}", err=True)
        raise typer.Exit(1)
    from flows.eval_gate import eval_gate

    out = eval_gate(version=version, config=str(config), overrides=list(set_))
    typer.echo(out["markdown"])
    raise typer.Exit(0 if out["promoted"] else 3)


def promote(version: str = typer.Argument(..., help="Registered model version to make champion."),
            reason: str = typer.Option("", help="Why (recorded as a tag)."),
            config: Path = CONFIG, set_: list[str] = SET) -> None:
    """Point the champion alias at VERSION by hand (no gate); the previous champion is remembered."""
    from infra.stages.gate import manual_promote

    cfg = _cfg(config, set_)
    out = manual_promote(cfg, version, reason)
    typer.echo(f"{cfg.tracking.registered_model}@{cfg.promote.alias}: "
               f"{out['champion_before'] or 'none'} -> {out['model_version']}")


def rollback(config: Path = CONFIG, set_: list[str] = SET) -> None:
    """Re-point the champion alias to the champion before the current one."""
    from infra.stages.gate import manual_rollback

    cfg = _cfg(config, set_)
    try:
        out = manual_rollback(cfg)
    except LookupError as exc:
        typer.echo(f"rollback: {exc}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{cfg.tracking.registered_model}@{cfg.promote.alias}: {out['from']} -> {out['to']}")


def champion(config: Path = CONFIG, set_: list[str] = SET) -> None:
    """Show the champion version and its lineage tags."""
    from infra.registry import Registry

    cfg = _cfg(config, set_)
    reg = Registry(cfg.resolved_tracking_uri(), cfg.tracking.registered_model)
    ch = reg.alias(cfg.promote.alias)
    if ch is None:
        typer.echo(f"{reg.name} has no {cfg.promote.alias!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{reg.name}@{cfg.promote.alias} = version {ch.version}")
    for k, v in sorted(ch.tags.items()):
        typer.echo(f"  {k}: {v}")


def register(app: typer.Typer) -> None:
    """Attach the operations commands."""
    app.command("serve")(serve)
    app.command("gate")(gate)
    app.command("promote")(promote)
    app.command("rollback")(rollback)
    app.command("champion")(champion)
