"""``deltaloop sandbox exec --runtime {docker,bwrap} FILE.py [--timeout S]``: debug one program.

Runs FILE.py as ``__main__`` in one sandbox with the run config's limits and prints exactly one JSON
object (``exit_code``, ``reason``, ``stdout_tail``, ``stderr_tail``, ``wall_seconds``). The command
exits 0 whenever the sandbox did its job — whatever the program did — and 3 when no sandbox could be
started (then the JSON has ``reason: "error"`` and the cause in ``stderr_tail``).
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import typer


class _Runtime(str, Enum):
    docker = "docker"
    bwrap = "bwrap"


def register(app: typer.Typer) -> None:
    """Attach the ``sandbox`` command group."""
    sandbox_app = typer.Typer(help="Run programs in sandboxes (debugging the scoring stage).", no_args_is_help=True)

    @sandbox_app.command("exec")
    def exec_cmd(
        file: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True, help="Python file to run."),
        runtime: _Runtime = typer.Option(_Runtime.bwrap, "--runtime", help="Sandbox runtime."),
        timeout: Optional[float] = typer.Option(None, "--timeout", min=0.001, help="Wall-clock limit (s)."),
        config: Optional[Path] = typer.Option(None, "--config", help="Run config whose sandbox section to use."),
        overrides: list[str] = typer.Option([], "--set", help="Config override, e.g. sandbox.memory_mb=128."),
    ) -> None:
        """Run FILE in a sandbox and print one JSON result."""
        from infra.config import ConfigError, load_config
        from infra.sandbox import SandboxError, create_pool

        try:
            cfg = load_config(config, overrides).sandbox
            cfg = cfg.model_copy(update={"runtime": runtime.value, "concurrency": 1, "min_warm": 1, "max_warm": 1})
            cfg = type(cfg).model_validate(cfg.model_dump())
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2)
        program = file.read_text(errors="replace")
        try:
            with create_pool(cfg) as pool:
                result = pool.exec(program, timeout).to_dict()
        except SandboxError as exc:
            typer.echo(json.dumps({"exit_code": None, "reason": "error", "stdout_tail": "",
                                   "stderr_tail": f"sandbox unavailable: {exc}", "wall_seconds": 0.0}))
            raise typer.Exit(3)
        typer.echo(json.dumps(result))
        if result.get("infra"):  # every attempt's sandbox failed: the program was never judged
            raise typer.Exit(3)

    app.add_typer(sandbox_app, name="sandbox")
