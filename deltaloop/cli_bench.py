"""``deltaloop bench NAME --json PATH``: run a benchmark, print a table, write a JSON file."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import typer


def _split(values: list[str] | None, cast: type) -> list | None:
    """Repeatable options that also accept comma lists (``--lr 1e-6,3e-6 --lr 1e-5``)."""
    if not values:
        return None
    return [cast(v) for item in values for v in item.split(",") if v.strip()]


def register(app: typer.Typer) -> None:
    """Attach the ``bench`` command."""

    @app.command("bench")
    def bench(
        name: str = typer.Argument(..., help="Benchmark name: weightsync, sandbox, rollout, train, chaos, sync, ..."),
        json_path: Path = typer.Option(Path("bench.json"), "--json", help="Where to write the JSON result."),
        quick: bool = typer.Option(False, "--quick", help="A smaller, faster run (smoke test)."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed of a benchmark that takes one (chaos)."),
        readers: Optional[int] = typer.Option(None, "--readers", min=1, help="sync: WAN readers (4)."),
        rtt_ms: Optional[float] = typer.Option(None, "--rtt-ms", min=0, help="sync: round trip per reader link (40)."),
        link_mbps: Optional[float] = typer.Option(None, "--link-mbps", min=0.1,
                                                  help="sync: MB/s per reader link, each way (50)."),
        versions: Optional[int] = typer.Option(None, "--versions", min=3, help="sync: versions per lr (51)."),
        lr: Optional[list[str]] = typer.Option(None, "--lr", help="sync: learning rates (repeatable or a,b,c)."),
        placement: Optional[list[str]] = typer.Option(
            None, "--placement", help="sync: object_store, broadcast, colocated (repeatable or a,b)."),
        delta_shard_kib: Optional[list[str]] = typer.Option(
            None, "--delta-shard-kib",
            help="sync: object_store once per publisher delta shard size, KiB (repeatable or a,b; shipped "
                 "4096); weightsync: its end-to-end delta sync once per size, two rounds."),
    ) -> None:
        """Run benchmark NAME; print a table and write JSON to --json."""
        from bench import BENCHMARKS

        try:
            run_bench = BENCHMARKS.get(name)
        except ValueError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2)
        try:
            given = {"seed": seed, "readers": readers, "rtt_ms": rtt_ms, "link_mbps": link_mbps,
                     "versions": versions, "lr": _split(lr, float), "placement": _split(placement, str),
                     "delta_shard_kib": _split(delta_shard_kib, int)}
        except ValueError as exc:
            typer.echo(f"bad option value: {exc}", err=True)
            raise typer.Exit(2)
        if any(k <= 0 for k in given["delta_shard_kib"] or ()):
            typer.echo("--delta-shard-kib takes positive sizes", err=True)
            raise typer.Exit(2)
        kwargs = {k: v for k, v in given.items() if v is not None}
        accepted = inspect.signature(run_bench).parameters
        for key in kwargs:
            if key not in accepted:
                typer.echo(f"benchmark {name!r} takes no --{key.replace('_', '-')}", err=True)
                raise typer.Exit(2)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        run_bench(json_path, quick, **kwargs)
        typer.echo(str(json_path))
