"""``deltaloop bench sync``: weight sync time per placement, against the floor and full checkpoints.

Records (a JSON list), one per placement and setting:

- ``object_store``: across regions, through shaped links (:mod:`bench.sync_wan`: S3 server and each
  reader in their own network namespaces, ``rtt_ms`` and ``link_mbps`` per reader; real AdamW
  versions of SmolLM2-135M at the shipped snapshot policy; late joiner).
- ``broadcast`` and ``colocated``: from ``bench.sync_broadcast.records(quick)`` and
  ``bench.sync_colocated.records(quick)`` when those modules exist (a note is printed otherwise).

Every record has ``placement``, ``readers``, ``rtt_ms``, ``link_mbps`` (MB/s, 10^6 bytes),
``lr``, ``versions``, ``p50_seconds``, ``p99_seconds`` (time to all readers), ``amortized_fraction``,
``full_seconds`` and ``floor_seconds``; see each module for the rest.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from infra.atomicio import write_json_atomic

PLACEMENTS = ("object_store", "broadcast", "colocated")
OTHER_MODULES = {"broadcast": "bench.sync_broadcast", "colocated": "bench.sync_colocated"}


def _other(placement: str, quick: bool, log: Any) -> list[dict[str, Any]]:
    """Records of a placement whose bench module another engineer owns (skipped when absent)."""
    name = OTHER_MODULES[placement]
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        log(f"note: {name} not present: no {placement} records")
        return []
    return list(mod.records(quick))


def _fmt(rec: dict[str, Any], key: str, fmt: str) -> str:
    val = rec.get(key)
    if val is None:
        return "-"
    try:
        return fmt.format(val)
    except (TypeError, ValueError):
        return str(val)


def table(records: list[dict[str, Any]], hardware: str) -> Any:
    """The rich table printed by :func:`run`."""
    from rich.table import Table

    t = Table(title=f"weight sync per placement — {hardware}")
    cols = [("placement", "placement", "{}"), ("readers", "readers", "{}"), ("RTT ms", "rtt_ms", "{:g}"),
            ("MB/s", "link_mbps", "{:g}"), ("lr", "lr", "{:g}"), ("versions", "versions", "{}"),
            ("delta shard B", "delta_shard_bytes", "{}"),
            ("p50 s", "p50_seconds", "{:.3f}"), ("p99 s", "p99_seconds", "{:.3f}"),
            ("floor s", "floor_seconds", "{:.3f}"), ("full s", "full_seconds", "{:.2f}"),
            ("x full", "speedup_vs_full", "{:.1f}"),
            ("x full floor", "speedup_vs_full_floor", "{:.1f}"), ("amortised", "amortized_fraction", "{:.3%}"),
            ("publish s", "publish_seconds_p50", "{:.3f}"), ("fetch s", "fetch_seconds_p50", "{:.3f}"),
            ("reader cpu s", "reader_cpu_seconds_p50", "{:.3f}"), ("joiner MB", "join_frame_bytes", "{}")]
    for name, _k, _f in cols:
        t.add_column(name, justify="right")
    for r in records:
        row = [_fmt(r, k, f) for _n, k, f in cols]
        if isinstance(r.get("join_frame_bytes"), int):
            row[-1] = f"{r['join_frame_bytes'] / 1e6:.1f}"
        t.add_row(*row)
    return t


def run(json_path: Path, quick: bool, *, readers: int = 4, rtt_ms: float = 40.0, link_mbps: float = 50.0,
        versions: int | None = None, lr: list[float] | None = None,
        placement: list[str] | None = None, delta_shard_kib: list[int] | None = None) -> list[dict[str, Any]]:
    """Run the placements asked for (default all); print a table; write the records to ``json_path``.

    ``readers``/``rtt_ms``/``link_mbps``/``versions``/``lr`` set the object_store WAN run (defaults:
    4 readers, 40 ms, 50 MB/s, 51 versions (12 quick), lr 1e-6, 3e-6, 1e-5 (1e-6 quick));
    ``delta_shard_kib`` runs it once per publisher delta shard size (default: the shipped one)."""
    from rich.console import Console

    from bench.sync_wan import records as wan_records
    from bench.weightsync import hardware

    chosen = list(placement or PLACEMENTS)
    unknown = [p for p in chosen if p not in PLACEMENTS]
    if unknown:
        raise ValueError(f"unknown placement {unknown[0]!r}; known: {', '.join(PLACEMENTS)}")
    console = Console(width=220)
    hw = hardware()
    console.print(f"[bold]sync benchmark[/] on {hw}")
    out: list[dict[str, Any]] = []
    if "object_store" in chosen:
        out += wan_records(quick, readers=readers, rtt_ms=rtt_ms, link_mbps=link_mbps, versions=versions,
                           lrs=tuple(lr) if lr else None,
                           delta_shard_bytes=tuple(k << 10 for k in delta_shard_kib) if delta_shard_kib else None,
                           log=console.print,
                           done=lambda recs: write_json_atomic(Path(f"{json_path}.partial"), recs, indent=2))
    for p in ("broadcast", "colocated"):
        if p in chosen:
            out += _other(p, quick, console.print)
    for r in out:
        r.setdefault("hardware", hw)
    console.print(table(out, hw))
    for r in out:
        if r.get("placement") == "object_store":
            console.print(
                f"object_store lr {r['lr']:g}: floor {r['floor_seconds']:.3f}s, p50 - floor "
                f"{r['p50_minus_floor_seconds'] * 1e3:.0f} ms; publish {r['publish_seconds_p50']:.3f}s, slowest "
                f"reader fetch {r['fetch_seconds_p50']:.3f}s ({r['reader_cpu_seconds_p50']:.3f} CPU-s); late joiner "
                f"at {r.get('join_version')}: {r.get('join_path')}, {r.get('join_frame_bytes', 0) / 1e6:.1f} MB "
                f"(bound {r.get('join_bound_bytes', 0) / 1e6:.1f}), bits ok {r.get('join_bits_ok')}; "
                f"latency by {r['latency_method']}")
    write_json_atomic(json_path, out, indent=2)
    return out
