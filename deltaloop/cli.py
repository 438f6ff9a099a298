"""The ``deltaloop`` command.

Sub-commands are registered from small modules (``cli_*.py``) so each capability owns its CLI.
Heavy imports happen inside the commands, so ``deltaloop --help`` stays fast.
"""

from __future__ import annotations

import typer

from deltaloop.env import set_defaults

app = typer.Typer(
    name="deltaloop",
    help="RL post-training pipeline: train, sync weights, roll out, score in sandboxes, evaluate, promote.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    """Attach every sub-command module that exists (each defines ``register(app)``)."""
    import importlib

    for name in ("cli_run", "cli_sync", "cli_sandbox", "cli_bench", "cli_ops"):
        try:
            module = importlib.import_module(f"deltaloop.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"deltaloop.{name}":
                continue
            raise
        module.register(app)


def _user_error(exc: BaseException) -> bool:
    """True for errors that describe the user's input or environment (a missing file, an empty or
    unreachable store, a corrupt version, no sandbox runtime...): those print one line, not a
    traceback. Anything else is a bug and keeps its traceback."""
    import sys

    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
        return True
    kinds: list[type] = []
    for module, names in (("infra.storage", ("StorageError",)), ("infra.weightsync.errors", ("WeightSyncError",)),
                          ("infra.weightsync.folder", ("FolderError",)),
                          ("infra.sandbox.types", ("SandboxError",)), ("infra.cluster.base", ("ClusterError",)),
                          ("infra.train.checkpoint", ("CheckpointError",)), ("infra.config", ("ConfigError",)),
                          ("mlflow.exceptions", ("MlflowException",))):
        mod = sys.modules.get(module)  # only what the command imported: nothing is loaded here
        kinds += [getattr(mod, n) for n in names if mod is not None and hasattr(mod, n)]
    return isinstance(exc, tuple(kinds))


def main() -> None:
    """Console entry point. ``DELTALOOP_DEBUG=1`` shows tracebacks of user-facing errors too."""
    import os
    import sys

    set_defaults()
    _register()
    try:
        app()
    except Exception as exc:
        if os.environ.get("DELTALOOP_DEBUG") or not _user_error(exc):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
