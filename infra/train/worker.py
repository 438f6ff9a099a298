"""One trainer rank. Run under torchrun by a cluster provider: ``python -m infra.train.worker --spec F``.

Every rank holds a full replica of the policy (fp32 master weights) and its AdamW state
(``trainer.engine: torch``), or a DeepSpeed ZeRO engine (``trainer.engine: deepspeed``). Rank 0 owns
the control channel: it receives a command, broadcasts it to all ranks, every rank executes it on
its shard of the data, gradients are all-reduced, and rank 0 replies.

Commands are idempotent by step: ``train_step`` for a step the trainer has already done returns
the stored result instead of training twice (a retried Prefect task never double-trains).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra.config import RunConfig
from infra.storage import ObjectStore, get_json, open_store, put_json, run_key


def _watch_parent(parent_pid: int) -> None:
    """Exit this rank when the flow process that started the group is gone (no orphans)."""

    def loop() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(3)
            except PermissionError:
                pass

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


class Trainer:
    """State of one rank: model, optimizer, step counter, weight publisher (rank 0)."""

    def __init__(self, cfg: RunConfig, spec: dict[str, Any], store: ObjectStore) -> None:
        self.cfg = cfg
        self.spec = spec
        self.store = store
        self.run_id: str = spec["run_id"]
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.step = 0
        self.model: torch.nn.Module | None = None
        self.tokenizer: Any = None
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.engine: Any = None  # DeepSpeed engine when configured
        self.publisher: Any = None

    # --------------------------------------------------------------------------------- init
    def op_init(self) -> dict[str, Any]:
        """Build or load the policy on every rank (same seed => same init), create the optimizer."""
        from infra.model import load_policy

        torch.manual_seed(self.cfg.seed)
        init_dir = self.spec.get("init_dir")
        if init_dir:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            model = AutoModelForCausalLM.from_pretrained(init_dir, torch_dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(init_dir)
        else:
            model, tokenizer = load_policy(self.cfg.model, seed=self.cfg.seed)
        model = model.float()
        model.train()
        self.model, self.tokenizer = model, tokenizer
        self._make_optimizer(self.cfg.trainer.lr)
        if self.cfg.trainer.kl_coef > 0:
            import copy

            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        n_params = sum(p.numel() for p in model.parameters())
        return {"params": n_params, "world_size": self.world, "engine": self.cfg.trainer.engine}

    def _make_optimizer(self, lr: float) -> None:
        assert self.model is not None
        tcfg = self.cfg.trainer
        opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=tcfg.weight_decay, betas=(0.9, 0.99))
        if tcfg.engine == "deepspeed":
            from infra.train.ds import wrap_deepspeed

            self.engine, self.optimizer = wrap_deepspeed(self.model, opt, tcfg, self.world)
        else:
            self.optimizer = opt

    # ---------------------------------------------------------------------------- gradients
    def _allreduce_and_step(self, grad_clip: float) -> float:
        """Average gradients over ranks (one flat all-reduce), clip, step. Returns the grad norm."""
        assert self.model is not None and self.optimizer is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= self.world
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)
        else:
            loss.backward()

    def _optimizer_step(self) -> float:
        if self.engine is not None:
            self.engine.step()
            norm = self.engine.get_global_grad_norm()
            return float(norm) if norm is not None else 0.0
        return self._allreduce_and_step(self.cfg.trainer.grad_clip)

    # ------------------------------------------------------------------------------ warmstart
    def op_warmstart(self) -> dict[str, Any]:
        """Supervised warm start on generated solutions, data-parallel over the ranks."""
        from infra.train.sft import sft_loss, sft_batches

        wcfg = self.cfg.warmstart
        assert self.model is not None and self.optimizer is not None
        if wcfg.steps == 0:
            return {"steps": 0}
        started = time.perf_counter()
        losses: list[float] = []
        warm = max(1, min(getattr(wcfg, "warmup_steps", 1), wcfg.steps))
        batches = sft_batches(self.tokenizer, self.cfg.env, self.cfg.env.seed, wcfg.steps, wcfg.batch_size,
                              self.rank, self.world)
        for i, batch in enumerate(batches, start=1):
            for group in self.optimizer.param_groups:
                group["lr"] = wcfg.lr * min(1.0, i / warm)
            loss = sft_loss(self.model, batch)
            self._backward(loss)
            self._optimizer_step()
            losses.append(float(loss))
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.trainer.lr
        # fresh optimizer state for RL: SFT moments would bias the first RL updates
        self.optimizer.state.clear()
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())
        return {"steps": len(losses), "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
                "seconds": time.perf_counter() - started}

    # --------------------------------------------------------------------------------- publish
    def op_publish(self) -> dict[str, Any]:
        """Publish the current weights as the next version (rank 0 writes; others wait)."""
        result: dict[str, Any] = {}
        if self.rank == 0:
            result = self._publish()
        return result

    def _publish(self) -> dict[str, Any]:
        from infra.model import publishable_state
        from infra.weightsync import VersionPublisher

        assert self.model is not None
        ws = self.cfg.weight_sync
        if self.publisher is None:
            self.publisher = VersionPublisher(
                self.store, run_key(self.run_id, None, "weights"), keyframe_every=ws.keyframe_every,
                codec=ws.codec, zstd_level=ws.zstd_level, threads=ws.threads,
            )
        info = self.publisher.publish(publishable_state(self.model))
        out = {k: getattr(info, k) for k in ("version", "kind", "bytes_written", "raw_bytes", "seconds")}
        out["changed_fraction"] = getattr(info, "changed_fraction", None)
        return out

    # ------------------------------------------------------------------------------ train step
    def op_train_step(self, step: int, rollouts_key: str, scores_key: str) -> dict[str, Any]:
        """One GRPO update from a scored rollout batch, then publish the new version."""
        from infra.train.grpo import build_batch, grpo_loss, group_advantages

        done_key = run_key(self.run_id, step, "train.json")
        if step <= self.step:
            return get_json(self.store, done_key) if self.rank == 0 else {}
        t0 = time.perf_counter()
        rollouts = get_json(self.store, rollouts_key)
        scores = get_json(self.store, scores_key)
        samples = rollouts["samples"]
        group = rollouts["group_size"]
        rewards = torch.tensor(scores["rewards"], dtype=torch.float32)
        adv = group_advantages(rewards, group)
        prompts = rollouts["prompts"]
        # shard by group so each rank holds whole groups where possible
        idx = list(range(self.rank, len(samples), self.world))
        total_tokens = sum(max(1, len(s["token_ids"])) for s in samples)
        tcfg = self.cfg.trainer
        metrics_acc: dict[str, float] = {}
        n_micro = 0
        norm = 0.0
        assert self.model is not None
        for _epoch in range(tcfg.inner_epochs):
            for start in range(0, len(idx), tcfg.micro_batch):
                chunk = idx[start : start + tcfg.micro_batch]
                batch = build_batch(
                    self.tokenizer,
                    [prompts[samples[i]["prompt_index"]] for i in chunk],
                    [samples[i] for i in chunk],
                    adv[chunk],
                )
                loss, m = grpo_loss(
                    self.model, batch, clip_eps=tcfg.clip_eps, kl_coef=tcfg.kl_coef,
                    ref_model=self.ref_model, total_tokens=total_tokens / self.world,
                    temperature=self.cfg.rollout.temperature,
                )
                self._backward(loss)
                for k, v in m.items():
                    metrics_acc[k] = metrics_acc.get(k, 0.0) + float(v)
                n_micro += 1
            norm = self._optimizer_step()
        local = torch.tensor([metrics_acc.get(k, 0.0) / max(1, n_micro) for k in sorted(metrics_acc)])
        if self.world > 1 and local.numel():
            dist.all_reduce(local)
            local /= self.world
        metrics = dict(zip(sorted(metrics_acc), local.tolist()))
        train_seconds = time.perf_counter() - t0
        self.step = step
        result: dict[str, Any] = {}
        if self.rank == 0:
            tokens = sum(len(s["token_ids"]) for s in samples)
            result = {
                "step": step,
                "metrics": {**metrics, "grad_norm": norm, "train_seconds": train_seconds,
                            "train_tokens_per_s": tokens * tcfg.inner_epochs / max(train_seconds, 1e-9),
                            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0},
                "publish": self._publish(),
            }
            put_json(self.store, done_key, result)
        return result

    # ---------------------------------------------------------------------------------- export
    def op_export(self, path: str) -> dict[str, Any]:
        """Save the current policy as a Hugging Face safetensors folder (rank 0)."""
        from infra.model import save_hf

        if self.rank == 0:
            assert self.model is not None
            save_hf(self.model, self.tokenizer, path)
        return {"path": path, "step": self.step}

    def op_ping(self) -> dict[str, Any]:
        """Health probe: every rank answers through a collective."""
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"ranks": int(t.item()), "step": self.step}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.pop("op")
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise ValueError(f"unknown trainer op {op!r}")
        return fn(**cmd)


def main() -> None:
    """Rank entry point: join the group, then serve commands until ``shutdown``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    cfg = RunConfig.model_validate(spec["config"])
    torch.set_num_threads(cfg.cluster.threads_per_rank)
    if os.environ.get("DELTALOOP_PARENT_PID"):
        _watch_parent(int(os.environ["DELTALOOP_PARENT_PID"]))
    dist.init_process_group(backend=cfg.cluster.backend)
    store = open_store(spec["store_uri"], spec.get("endpoint_url"), spec.get("region"))
    trainer = Trainer(cfg, spec, store)
    listener = conn = None
    if trainer.rank == 0:
        from infra.rpc import serve_listener

        bind = "127.0.0.1" if cfg.cluster.type == "local" else "0.0.0.0"
        listener = serve_listener(store, spec["control_key"], bytes.fromhex(os.environ["DELTALOOP_AUTHKEY"]), bind)
        conn = listener.accept()
    while True:
        box: list[Any] = [None]
        if trainer.rank == 0:
            assert conn is not None
            try:
                box[0] = conn.recv()
            except (EOFError, OSError):
                box[0] = {"op": "shutdown"}
        dist.broadcast_object_list(box, src=0)
        cmd = dict(box[0])
        op = cmd.get("op")
        if op == "shutdown":
            if conn is not None:
                try:
                    conn.send({"ok": True})
                except OSError:
                    pass
            break
        try:
            reply = trainer.handle(cmd)
        except Exception as exc:  # report to the flow; the rank keeps serving
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                     "retryable": bool(getattr(exc, "retryable", False))}
        if conn is not None:
            conn.send(reply)
    if listener is not None:
        listener.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
