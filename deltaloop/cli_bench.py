"""``deltaloop bench NAME --json PATH``: run a benchmark, print a table, write a JSON file."""

from __future__ import annotations

import inspect
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Attach the ``bench`` command."""

    @app.command("bench")
    def bench(
        name: str = typer.Argument(..., help="Benchmark name: weightsync, sandbox, rollout, train, chaos."),
        json_path: Path = typer.Option(Path("bench.json"), "--json", help="Where to write the JSON result."),
        quick: bool = typer.Option(False, "--quick", help="A smaller, faster run (smoke test)."),
        seed: int | None = typer.Option(None, "--seed", help="Seed of a benchmark that takes one (chaos)."),
    ) -> None:
        """Run benchmark NAME; print a table and write JSON to --json."""
        from bench import BENCHMARKS

        try:
            run_bench = BENCHMARKS.get(name)
        except ValueError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2)
        kwargs: dict[str, int] = {}
        if seed is not None:
            if "seed" not in inspect.signature(run_bench).parameters:
                typer.echo(f"benchmark {name!r} takes no --seed", err=True)
                raise typer.Exit(2)
            kwargs["seed"] = seed
        json_path.parent.mkdir(parents=True, exist_ok=True)
        run_bench(json_path, quick, **kwargs)
        typer.echo(str(json_path))
