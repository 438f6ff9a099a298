"""``deltaloop bench NAME --json PATH``: run a benchmark, print a table, write a JSON file."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Attach the ``bench`` command."""

    @app.command("bench")
    def bench(
        name: str = typer.Argument(..., help="Benchmark name: weightsync, sandbox, rollout, train."),
        json_path: Path = typer.Option(Path("bench.json"), "--json", help="Where to write the JSON result."),
        quick: bool = typer.Option(False, "--quick", help="A smaller, faster run (smoke test)."),
    ) -> None:
        """Run benchmark NAME; print a table and write JSON to --json."""
        from bench import BENCHMARKS

        try:
            run_bench = BENCHMARKS.get(name)
        except ValueError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        run_bench(json_path, quick)
        typer.echo(str(json_path))
