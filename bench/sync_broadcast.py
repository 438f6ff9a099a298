"""Broadcast placement on loopback, measured side by side with the object store (``deltaloop bench
sync``'s ``broadcast`` records; run alone with ``python -m bench.sync_broadcast [--quick] [--json PATH]``).

Per model (the demo's tiny model; with ``quick`` false also SmolLM2-135M from ``configs/smollm2.yaml``):

- two real rollout worker processes, started by the real services: one with
  ``weight_sync.placement: broadcast`` (:class:`~infra.rollout.broadcast_service.BroadcastRolloutService`),
  one with ``object_store`` (:class:`~infra.rollout.service.RolloutService`, a file store);
- a trainer stand-in in this process: the model under real AdamW steps at the config's
  ``trainer.lr`` (a policy-gradient loss on random tokens with random ±1 advantages, one optimizer
  throughout), whose broadcast ops are the trainer's own
  (:class:`~infra.train.broadcast_ops.BroadcastOps`, the mixin of the trainer rank);
- per version, from "the trainer has the new weights" to "the worker serves them" (its load
  returned): broadcast = send and receive over the group (pack, buckets, digests, the engine's copy);
  object store = publish (bf16 cast, delta encode, write) plus the worker's fetch and apply. Which
  of the two goes first alternates per version. Version 1 (a full model for both) is left out of
  the percentiles.
- bytes on the wire per version and reader: what the receiver got over the group (full bf16 model
  plus header, layout and digests) vs what the publisher wrote (deltas and background snapshots).

In a run under the broadcast placement the trainer publishes each version to the store after
sending it (:mod:`infra.train.publish_behind`), while the next batch is generated, so what the
placement changes on the path from "trainer has the weights" to "worker serves them" is
``p50_seconds`` against ``object_store_p50_seconds`` (publish + load: ``broadcast_vs_object_store``);
``broadcast_vs_object_store_load`` compares the send with the load alone.

``full_seconds`` and ``floor_seconds`` are None: every broadcast version is a full model, and on
loopback there is no link to take a floor from.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from infra.train.broadcast_ops import BroadcastOps

MODELS = {"demo": ("configs/demo.yaml", 20), "smollm2": ("configs/smollm2.yaml", 12)}  # config, versions
QUICK_VERSIONS = 8


class _Engine:
    def __init__(self, model: Any) -> None:
        self.model = model

    def full_params(self) -> dict[str, Any]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


class BenchTrainer(BroadcastOps):
    """Trainer rank 0 of a one-rank group, in this process: the model, its version, the broadcast ops.
    ``call`` is :meth:`~infra.train.service.TrainerService.call`'s shape."""

    def __init__(self, cfg: Any, model: Any) -> None:
        self.cfg, self.rank, self.world, self.weights_version = cfg, 0, 1, 0
        self.engine = _Engine(model)

    def call(self, op: str, timeout_s: float = 3600.0, **kwargs: Any) -> dict[str, Any]:
        return getattr(self, f"op_{op}")(**kwargs)


def _steps(model: Any, lr: float, batch: int, seqlen: int, seed: int) -> Any:
    """AdamW policy-gradient steps on ``model`` (one per ``next``)."""
    import torch

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
    vocab = model.get_input_embeddings().num_embeddings
    model.train()
    while True:
        tokens = torch.randint(0, vocab, (batch, seqlen))
        adv = torch.randint(0, 2, (batch,)).float() * 2 - 1
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        yield


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def measure(name: str, versions: int) -> dict[str, Any]:
    """One record: ``versions`` versions of model ``name`` to both workers (see the module doc)."""
    import torch

    from infra.config import load_config
    from infra.model import load_policy, publishable_state
    from infra.rollout.broadcast_service import BroadcastRolloutService
    from infra.rollout.service import RolloutService
    from infra.storage import FileStore, run_key
    from infra.weightsync import VersionPublisher

    path = MODELS[name][0]
    with tempfile.TemporaryDirectory(prefix="bench-bcast-") as d:
        cfg = load_config(path, ["weight_sync.placement=broadcast", f"run_root={d}", "rollout.start_timeout_s=900"])
        store = FileStore(Path(d) / "store")
        bc = BroadcastRolloutService(cfg, "bcast", store, Path(d) / "bcast")
        os_cfg = load_config(path, ["weight_sync.placement=object_store", f"run_root={d}",
                                    "rollout.start_timeout_s=900"])
        obj = RolloutService(os_cfg, "objstore", store, Path(d) / "objstore")
        model, _tok = load_policy(cfg.model, seed=cfg.seed)
        model = model.float()
        trainer = BenchTrainer(cfg, model)
        publisher = VersionPublisher(store, run_key("objstore", None, "weights"),
                                     **os_cfg.weight_sync.publisher_kwargs())
        try:
            bc.launch()
            obj.launch()
            bc.wait_ready()
            obj.wait_ready()
            bc.bind_trainer(trainer)
            return _versions(name, cfg.trainer.lr, versions, model, trainer, bc, obj, publisher,
                             publishable_state, torch)
        finally:
            publisher.close()
            bc.close()
            obj.close()


def _versions(name: str, lr: float, versions: int, model: Any, trainer: BenchTrainer, bc: Any, obj: Any,
              publisher: Any, publishable_state: Any, torch: Any) -> dict[str, Any]:
    """Train, then sync each version both ways; the record."""
    steps = _steps(model, lr, batch=2, seqlen=32 if name == "demo" else 16, seed=0)
    rows: list[dict[str, Any]] = []
    for v in range(1, versions + 1):
        if v > 1:
            next(steps)
        trainer.weights_version = v

        def via_store() -> tuple[float, float, int]:
            t0 = time.perf_counter()
            info = publisher.publish(publishable_state(model))
            t1 = time.perf_counter()
            res = obj.load(v)
            assert res["version"] == v and res["applied"], res
            return time.perf_counter() - t0, time.perf_counter() - t1, int(info.bytes_written)

        def via_group() -> tuple[float, int]:
            t0 = time.perf_counter()
            res = bc.load(v)
            assert res["version"] == v and res["applied"] and res["via"] == "broadcast", res
            return time.perf_counter() - t0, int(res["bytes"])

        if v % 2:
            (s_all, s_load, s_bytes), (b_s, b_bytes) = via_store(), via_group()
        else:
            (b_s, b_bytes), (s_all, s_load, s_bytes) = via_group(), via_store()
        rows.append({"version": v, "broadcast_s": b_s, "broadcast_bytes": b_bytes, "store_s": s_all,
                     "store_load_s": s_load, "store_bytes": s_bytes})
    publisher.wait_snapshot()
    return _record(name, lr, rows, sum(p.numel() for p in model.parameters()),
                   sum(t.numel() * 2 for t in publishable_state(model).values()), publisher.snapshot_bytes_written)


def _record(name: str, lr: float, rows: list[dict[str, Any]], params: int, bf16: int, snapshots: int) -> dict[str, Any]:
    from bench.weightsync import hardware

    later = rows[1:]
    b = [r["broadcast_s"] for r in later]
    s = [r["store_s"] for r in later]
    return {
        "placement": "broadcast", "model": name, "params": params, "bf16_bytes": bf16, "readers": 1, "rtt_ms": 0,
        "link_mbps": None, "lr": lr, "versions": len(rows), "transport": "gloo over loopback TCP",
        "p50_seconds": statistics.median(b), "p99_seconds": _pct(b, 0.99),
        "amortized_fraction": sum(r["broadcast_bytes"] for r in later) / len(later) / bf16,
        "object_store_p50_seconds": statistics.median(s), "object_store_p99_seconds": _pct(s, 0.99),
        "object_store_load_p50_seconds": statistics.median(r["store_load_s"] for r in later),
        "object_store_amortized_fraction": (sum(r["store_bytes"] for r in later) + snapshots) / len(later) / bf16,
        "broadcast_vs_object_store": statistics.median(b) / statistics.median(s),
        "broadcast_vs_object_store_load": statistics.median(b) / statistics.median(r["store_load_s"] for r in later),
        "first_version_broadcast_seconds": rows[0]["broadcast_s"], "first_version_store_seconds": rows[0]["store_s"],
        "full_seconds": None, "floor_seconds": None,
        "per_version": rows, "hardware": hardware(), "load_avg_1min": os.getloadavg()[0],
    }


def records(quick: bool) -> list[dict[str, Any]]:
    """The broadcast records of ``deltaloop bench sync`` (quick: the demo model, fewer versions)."""
    names = ["demo"] if quick else list(MODELS)
    return [measure(n, QUICK_VERSIONS if quick else MODELS[n][1]) for n in names]


def main() -> None:
    """``python -m bench.sync_broadcast [--quick] [--json PATH]``: print the records (and write them)."""
    from infra.atomicio import write_json_atomic

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    recs = records(args.quick)
    for r in recs:
        print(f"{r['model']}: {r['versions']} versions, broadcast p50 {r['p50_seconds']:.3f}s "
              f"p99 {r['p99_seconds']:.3f}s "
              f"({r['amortized_fraction']:.1%} of bf16 on the wire) vs object store p50 "
              f"{r['object_store_p50_seconds']:.3f}s (load alone {r['object_store_load_p50_seconds']:.3f}s, "
              f"{r['object_store_amortized_fraction']:.2%} of bf16); ratio {r['broadcast_vs_object_store']:.2f}, "
              f"{r['broadcast_vs_object_store_load']:.2f} against the load alone")
    if args.json:
        write_json_atomic(args.json, recs, indent=2)


if __name__ == "__main__":
    main()
