"""``deltaloop plan sandboxes --concurrency N [...]``: size a warm sandbox fleet by simulation.

Prints the smallest warm buffer (sandboxes beyond one per in-flight rollout) whose simulated p99
scoring queue wait stays under the target, with its idle cost per hour, and writes the whole
answer (every buffer evaluated, the method, the inputs) as JSON with ``--json``. The model and the
method at scale are described in :mod:`infra.sandbox.plan` and :mod:`infra.sandbox.plan_search`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Attach the ``plan`` command group."""
    plan_app = typer.Typer(help="Plan capacity by simulation.", no_args_is_help=True)

    @plan_app.command("sandboxes")
    def sandboxes(
        concurrency: int = typer.Option(..., "--concurrency", min=1, help="Rollouts scored at once (clients)."),
        create_rate: Optional[float] = typer.Option(None, "--create-rate", min=1e-9,
                                                    help="Provider limit: sandbox creations per second (default none)."),
        burst: Optional[float] = typer.Option(None, "--burst", min=1.0,
                                              help="Provider limit: creations allowed at once (default: one second's)."),
        price: float = typer.Option(0.05, "--price", min=0.0, help="USD per sandbox-hour (an assumption; set yours)."),
        target_p99_ms: float = typer.Option(100.0, "--target-p99-ms", min=0.0, help="Largest p99 queue wait (ms)."),
        think_ms: float = typer.Option(5000.0, "--think-ms", min=0.0,
                                       help="Mean generation time of a rollout before each scoring job (ms)."),
        max_jobs: int = typer.Option(200, "--max-jobs-per-sandbox", min=1, help="Recycle limit (sandbox.max_jobs_per_sandbox)."),
        horizon_s: float = typer.Option(600.0, "--horizon-s", min=1.0, help="Simulated steady-state seconds."),
        bench: Optional[Path] = typer.Option(None, "--bench", help="`deltaloop bench sandbox` JSON with the "
                                             "measured distributions (default: a shipped bwrap run)."),
        runtime: str = typer.Option("bwrap", "--runtime", help="Which runtime's record of --bench to use."),
        exact_max: int = typer.Option(1000, "--exact-max", min=10, help="Largest fleet simulated one client each; "
                                      "bigger ones are scaled down to it."),
        seed: int = typer.Option(0, "--seed", help="Simulation seed."),
        json_path: Optional[Path] = typer.Option(None, "--json", help="Write the plan as JSON here."),
    ) -> None:
        """The smallest warm buffer that keeps p99 scoring wait <= the target, and its idle cost."""
        from infra.sandbox.plan_search import Load, load_distributions, plan

        dists = load_distributions(bench, runtime)
        load = Load(concurrency, think_ms=think_ms, create_rate=create_rate, burst=burst,
                    max_jobs_per_sandbox=max_jobs, horizon_s=horizon_s, price_per_hour=price)
        out = plan(load, dists, target_p99_ms, seed=seed, exact_max=exact_max)
        typer.echo(_text(out))
        if json_path is not None:
            from infra.atomicio import write_json_atomic

            json_path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(json_path, out, indent=2)
            typer.echo(str(json_path))

    app.add_typer(plan_app, name="plan")


def _text(out: dict) -> str:
    rate = (f"{out['create_rate']:g}/s, burst {out['burst']:g}" if out["create_rate"] is not None else "unlimited")
    lines = [f"concurrency {out['concurrency']:,}, think {out['think_ms']:g} ms, recycle every "
             f"{out['max_jobs_per_sandbox']} jobs, creation {rate}, horizon {out['horizon_s']:g} s ({out['method']})",
             f"sandboxes retired {out['replacement_per_s']:,.2f}/s"
             + ("" if out["steady_state"] else " > creation rate: no buffer keeps up for ever; sized for the horizon"),
             f"{'buffer':>12} {'p50 wait ms':>12} {'p99 wait ms':>12} {'idle':>12} {'idle $/h':>10}"]
    for p in out["curve"]:
        mark = " <-" if p["buffer"] == out["buffer"] else ""
        lines.append(f"{p['buffer']:>12,} {p['p50_wait_ms']:>12.1f} {p['p99_wait_ms']:>12.1f} "
                     f"{p['mean_idle_sandboxes']:>12,.0f} {p['idle_cost_per_hour']:>10,.2f}{mark}")
    if out["buffer"] is None:
        lines.append(f"no buffer up to {out['search_cap_buffer']:,} keeps p99 wait <= {out['target_p99_ms']:g} ms")
    else:
        lines.append(f"buffer {out['buffer']:,}: p99 wait {out['p99_wait_ms']:.1f} ms <= {out['target_p99_ms']:g} ms, "
                     f"idle cost ${out['idle_cost_per_hour']:,.2f}/h at ${out['price_per_sandbox_hour']:g} "
                     f"per sandbox-hour; filling {out['concurrency'] + out['buffer']:,} sandboxes takes "
                     f"{out['fill_seconds']:,.0f} s")
    return "\n".join(lines)
