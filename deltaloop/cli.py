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


def main() -> None:
    """Console entry point."""
    set_defaults()
    _register()
    app()


if __name__ == "__main__":
    main()
