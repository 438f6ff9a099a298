"""A Typer app carrying only the given ``deltaloop`` command modules, for CliRunner tests that drive
one command group without registering (and importing) every other one."""

from __future__ import annotations

from typing import Callable

import typer


def cli_app(*registers: Callable[[typer.Typer], None]) -> typer.Typer:
    """A ``deltaloop``-like app with the commands each ``register(app)`` attaches."""
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """deltaloop"""

    for register in registers:
        register(app)
    return app
