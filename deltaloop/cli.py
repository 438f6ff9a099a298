"""The ``deltaloop`` command.

Sub-commands are registered from small modules (``cli_*.py``) so each capability owns its CLI.
Heavy imports happen inside the commands, so ``deltaloop --help`` stays fast.
"""

from __future__ import annotations

import typer

from infra.process_env import set_defaults

app = typer.Typer(
    name="deltaloop",
    help="RL post-training pipeline: train, sync weights, roll out, score in sandboxes, evaluate, promote.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    """Attach every sub-command module (each defines ``register(app)``)."""
    from deltaloop import cli_bench, cli_ops, cli_plan, cli_report, cli_run, cli_sandbox, cli_sync

    for module in (cli_run, cli_sync, cli_sandbox, cli_bench, cli_ops, cli_plan, cli_report):
        module.register(app)


def _user_error(exc: BaseException) -> bool:
    """True for errors that describe the user's input or environment (a missing file, an empty or
    unreachable store, a corrupt version, no sandbox runtime...): every
    :class:`~infra.errors.DeltaloopError`, file errors and MLflow's errors. Those print one line,
    not a traceback; anything else is a bug and keeps its traceback."""
    import sys

    from infra.errors import DeltaloopError

    if isinstance(exc, (DeltaloopError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
        return True
    mlflow_exceptions = sys.modules.get("mlflow.exceptions")  # loaded only if the command used MLflow
    return mlflow_exceptions is not None and isinstance(exc, mlflow_exceptions.MlflowException)


def _no_traceback_for_project_errors() -> None:
    """Prefect logs a failed task or flow run with its traceback. A :class:`~infra.errors.DeltaloopError`
    is a described failure that :func:`main` prints as one ``error:`` line, so its log records keep
    their message and lose the traceback."""
    import logging

    class NoTraceback(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            from infra.errors import DeltaloopError

            if record.exc_info and isinstance(record.exc_info[1], DeltaloopError):
                record.exc_info = None
                record.exc_text = None
            return True

    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logging.getLogger(name).addFilter(NoTraceback())


def main() -> None:
    """Console entry point. ``DELTALOOP_DEBUG=1`` shows tracebacks of user-facing errors too."""
    import os
    import sys

    set_defaults()
    _register()
    if not os.environ.get("DELTALOOP_DEBUG"):
        _no_traceback_for_project_errors()
    try:
        app()
    except Exception as exc:
        if os.environ.get("DELTALOOP_DEBUG") or not _user_error(exc):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
