"""One trainer rank. Run under torchrun by a cluster provider: ``python -m infra.train.worker``.

The rank reads its :class:`infra.specs.TrainerSpec` (the trainer's sections of the resolved run
config and the run's identity) from ``$DELTALOOP_SPEC``, or from ``--spec FILE`` when run by hand.

The rank builds the policy and wraps it in the configured engine (``trainer.engine``: torch replica
with a flat gradient all-reduce, FSDP, or DeepSpeed ZeRO; see :mod:`infra.train.engines`). Rank 0
owns the control channel (:mod:`infra.rpc`, keyed by the run secret): it receives a command,
broadcasts it to all ranks, every rank executes it on its shard of the data, and rank 0 replies. A
peer that fails the channel's handshake is logged and ignored; when the flow's connection ends, rank 0
serves the flow's next connection, and with none for ``cluster.start_timeout_s`` the group shuts down.

Steps are keyed by (run, step) and strictly ordered: ``train_step`` for a step the trainer has
already done returns the stored result (a retried Prefect task never double-trains), and a step
that skips ahead is refused (the stage layer replays the missing steps from their stored rollouts).
The weights after step s are published as the next version only if that version is not committed
yet (a replay after a restart re-derives bit-identical weights and reuses the published version).
Every ``trainer.checkpoint_every`` steps the full state goes to the object store
(:mod:`infra.train.checkpoint`); ``restore`` loads the newest committed one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from infra.errors import DeltaloopError, is_retryable
from infra.lifeline import exit_with_parent
from infra.specs import TrainerSpec
from infra.storage import ObjectStore, get_json, open_store, put_json, run_key
from infra.train.broadcast_ops import BroadcastOps
from infra.train.colocated_ops import ColocatedOps

if TYPE_CHECKING:
    from infra.train.grpo import BatchPlan
    from infra.weightsync import VersionPublisher


class StepOrderError(DeltaloopError):
    """``train_step`` was asked for a step beyond the next one (earlier steps must be replayed first)."""

    retryable = False


def batch_record(rollouts: dict[str, Any], scores: dict[str, Any], prompts: dict[str, Any] | None) -> dict[str, Any]:
    """What a step trained, to compare runs step by step (a resumed or disturbed run against an
    undisturbed one): ``prompt_ids`` (the ids of the batch's items, in order; None without the
    prompt batch), ``rollout_version`` (the weight version that generated the batch) and
    ``batch_sha256`` (a digest of every sample's prompt index and token ids, the rewards and the mask)."""
    body = {"samples": [[s["prompt_index"], s["token_ids"]] for s in rollouts["samples"]],
            "rewards": scores["rewards"], "masked": scores.get("masked")}
    ids = [str(item["id"]) for item in prompts["items"]] if prompts and "items" in prompts else None
    return {"prompt_ids": ids, "rollout_version": int(rollouts.get("version", 0)),
            "batch_sha256": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


class Trainer(BroadcastOps, ColocatedOps):
    """State of one rank: engine (model + optimizer), step, weights version, publisher (rank 0)."""

    def __init__(self, spec: TrainerSpec, store: ObjectStore) -> None:
        self.cfg = spec.config  # the trainer's sections of the run config (same names as RunConfig's)
        self.spec = spec
        self.store = store
        self.run_id = spec.run_id
        self.init_dir = spec.init_dir  # a registered model to start from (None: build from config)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.step = 0
        self.weights_version = 0  # version of the current weights (published or, in a replay, re-derived)
        self.model: torch.nn.Module | None = None
        self.tokenizer: Any = None
        self.ref_model: torch.nn.Module | None = None
        self.engine: Any = None
        self.publisher: Any = None  # rank 0's VersionPublisher, or every rank's ShardedPublish (publish_ranks > 1)

    # --------------------------------------------------------------------------------- init
    def op_init(self) -> dict[str, Any]:
        """Build or load the policy on every rank (same seed => same init), wrap it in the engine."""
        from infra.model import load_policy
        from infra.train.engines import create_engine

        torch.manual_seed(self.cfg.seed)
        model, tokenizer = load_policy(self.cfg.model, seed=self.cfg.seed, folder=self.init_dir)
        model = model.float()
        tcfg = self.cfg.trainer
        if tcfg.activation_checkpointing:
            model.config.use_cache = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.cfg.trainer.kl_coef > 0:
            import copy

            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if tcfg.lora.enabled:
            from infra.train.lora import apply_lora

            model = apply_lora(model, tcfg.lora)
        model.train()
        if self.cfg.cluster.backend == "nccl" and torch.cuda.is_available():
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
            if tcfg.engine == "torch":
                model = model.to(dev)
        self.model, self.tokenizer = model, tokenizer
        n_params = sum(p.numel() for p in model.parameters())
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.engine = create_engine(model, tcfg, self.world, self.rank)
        return {"params": n_params, "trainable_params": n_train, "world_size": self.world, "engine": tcfg.engine,
                "zero_stage": tcfg.zero_stage if tcfg.engine == "deepspeed" else None}

    # ------------------------------------------------------------------------------ warmstart
    def op_warmstart(self, examples_key: str | None = None) -> dict[str, Any]:
        """Supervised warm start (:func:`infra.train.sft.sft_loop`), data-parallel over the ranks.

        ``examples_key`` names the per-step (prompt, target) pairs the provision stage drew from the
        environment and stored (:mod:`infra.stages.warmstart`); each rank trains on its slice of every
        step. Afterwards the learning rate is the RL one and the optimizer state is fresh.
        """
        from infra.train.sft import sft_batches, sft_loop

        wcfg = self.cfg.warmstart
        if wcfg.steps == 0:
            return {"steps": 0}
        if examples_key is None:
            raise ValueError("warmstart needs examples_key: the stored (prompt, target) pairs of every step")
        started = time.perf_counter()
        steps = get_json(self.store, examples_key)["steps"]
        out = sft_loop(self.engine, sft_batches(self.tokenizer, steps, self.rank, self.world), wcfg)
        self.engine.set_lr(self.cfg.trainer.lr)
        # fresh optimizer state for RL: SFT moments would bias the first RL updates
        self.engine.reset_optimizer()
        if self.ref_model is not None:  # the KL reference is the warm-started policy
            box = [self._hf_state()]
            if self.world > 1:
                dist.broadcast_object_list(box, src=0)
            self.ref_model.load_state_dict(box[0])
        return {"steps": out["steps"], "final_loss": out["final_loss"], "seconds": time.perf_counter() - started}

    def _hf_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: full fp32 weights under Hugging Face names (LoRA merged) on rank 0."""
        full = self.engine.full_params()
        lcfg = self.cfg.trainer.lora
        if full is not None and lcfg.enabled:
            from infra.train.lora import merged_state

            full = merged_state(full, lcfg.alpha / lcfg.rank)
        return full

    # --------------------------------------------------------------------------------- publish
    def _publishable(self, owner: Callable[[str], int] | None = None) -> dict[str, torch.Tensor] | None:
        """Collective: the tensors to publish, bf16, on rank 0 (with ``owner``, those each rank owns:
        a sharded publish); adapters only with LoRA (rank 0)."""
        lcfg = self.cfg.trainer.lora
        if lcfg.enabled:
            from infra.train.lora import publishable_adapter_state

            full = self.engine.full_params()
            return None if full is None else publishable_adapter_state(full, lcfg.alpha / lcfg.rank)
        mine = self.engine.owned_params(owner or (lambda _name: 0))
        if owner is None and self.rank != 0:
            return None
        return {n: t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().clone() for n, t in mine.items()}

    def _publish_next(self) -> dict[str, Any]:
        """Collective: make the current weights version ``weights_version + 1``.

        If that version is already committed (a replay after a restart), it is not written again: the
        replayed weights are bit-identical to the ones published before the failure."""
        if self.cfg.weight_sync.placement == "colocated":  # no sync: the ranks generate with these parameters
            return self._colocated_publish()
        self._bc_settle()
        t0 = time.perf_counter()
        target = self.weights_version + 1
        sharded = self.cfg.weight_sync.publish_ranks > 1
        newest = [self._open_sharded().version if sharded else None]  # (a collective)
        if self.rank == 0 and not sharded:
            newest[0] = self._open_publisher().version
        if self.world > 1 and not sharded:
            dist.broadcast_object_list(newest, src=0)
        self.weights_version = target
        if target <= newest[0]:
            return {"version": target, "kind": "existing", "bytes_written": 0, "raw_bytes": 0, "seconds": 0.0,
                    "changed_fraction": None}
        if sharded:
            if newest[0] != target - 1:
                raise RuntimeError(f"the store's newest version is {newest[0]}, cannot publish {target}")
            return self.publisher.publish(self._publishable(owner=self.publisher.owner.get), t0=t0)
        tensors = self._publishable()
        if self.rank != 0:
            return {}
        assert tensors is not None and self.publisher is not None
        if self.publisher.version != target - 1:
            raise RuntimeError(f"publisher is at version {self.publisher.version}, cannot publish {target}")
        if self.cfg.weight_sync.placement == "broadcast":  # sent first, published after (publish_behind.py)
            return self._bc_defer(target, tensors, t0)
        return self._publish_tensors(tensors, t0)

    def _publish_tensors(self, tensors: dict[str, torch.Tensor], t0: float) -> dict[str, Any]:
        """Rank 0: publish ``tensors`` as the publisher's next version; the record of it (``seconds``
        counts from ``t0``: gather + cast + encode + upload)."""
        return self._open_publisher().publish(tensors).record(t0)

    def _open_publisher(self) -> "VersionPublisher":
        """Rank 0's publisher, made on first use: it continues after the newest committed version."""
        from infra.weightsync import VersionPublisher

        if self.publisher is None:
            ws = self.cfg.weight_sync
            self.publisher = VersionPublisher(self.store, run_key(self.run_id, None, "weights"),
                                              **ws.publisher_kwargs())
        return self.publisher

    def _open_sharded(self) -> Any:
        """Collective: every rank's :class:`~infra.train.sharded_publish.ShardedPublish`, made on first use."""
        from infra.train.sharded_publish import ShardedPublish

        if self.publisher is None:
            self.publisher = ShardedPublish(self.store, run_key(self.run_id, None, "weights"), self.cfg.weight_sync,
                                            self.rank, self.world, self.engine.param_numels())
        return self.publisher

    def op_publish(self) -> dict[str, Any]:
        """Publish the current weights as the next version (rank 0 writes; others take part in gathers)."""
        return self._publish_next()

    def op_republish(self, version: int) -> dict[str, Any]:
        """Collective: write weight version ``version`` again, as a keyframe of the current weights,
        after a reader found one of its objects corrupt or missing. Only the version these weights
        are (the newest: the flow asks right after the step that published it)."""
        self._bc_settle()
        if version != self.weights_version:
            raise ValueError(f"cannot republish weight version {version}: the trainer holds version "
                             f"{self.weights_version}")
        t0 = time.perf_counter()
        if self.cfg.weight_sync.publish_ranks > 1:
            if self._open_sharded().version != version:
                raise ValueError(f"cannot republish weight version {version}: it is not the newest published")
            return self.publisher.republish(self._publishable(owner=self.publisher.owner.get), t0=t0)
        tensors = self._publishable()
        if self.rank != 0:
            return {}
        assert tensors is not None
        publisher = self._open_publisher()
        if publisher.version != version:
            raise ValueError(f"cannot republish weight version {version}: the newest published is {publisher.version}")
        info = publisher.republish(tensors)
        return {"version": info.version, "kind": info.kind, "bytes_written": info.bytes_written,
                "seconds": time.perf_counter() - t0}

    # ---------------------------------------------------------------------------- checkpoints
    def op_checkpoint(self, step: int) -> dict[str, Any]:
        """Save the full trainer state as the checkpoint of ``step`` (collective; committed by rank 0)."""
        from infra.train import checkpoint

        self._bc_settle()  # the version the checkpoint names is committed before it
        tcfg = self.cfg.trainer
        meta = {"weights_version": self.weights_version, "engine": tcfg.engine, "zero_stage": tcfg.zero_stage,
                "lora": tcfg.lora.enabled, "config_hash": self.cfg.config_hash()}
        manifest = checkpoint.save(self.store, self.run_id, step, self.engine, meta, self.rank, self.world,
                                   tcfg.keep_checkpoints)
        if self.rank != 0:
            return {}
        return {"step": step, "seconds": manifest["seconds"], "bytes": sum(manifest["keys"].values())}

    def op_restore(self, step: int | None = None) -> dict[str, Any]:
        """Load checkpoint ``step`` (None: the newest committed). ``{"step": None}`` if there is none."""
        from infra.train import checkpoint

        self._bc_settle()
        box: list[Any] = [step]
        if step is None and self.rank == 0:
            steps = checkpoint.committed_steps(self.store, self.run_id)
            box[0] = steps[-1] if steps else None
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return {"step": None}
        manifest = checkpoint.restore(self.store, self.run_id, int(box[0]), self.engine, self.rank, self.world)
        self.step = int(manifest["step"])
        self.weights_version = int(manifest["weights_version"])
        if self.publisher is not None:  # its snapshot in flight is abandoned: a new one continues from the store
            self.publisher.close()
        self.publisher = None  # rebuilt from the store on the next publish
        return {"step": self.step, "weights_version": self.weights_version}

    # ------------------------------------------------------------------------------ train step
    def op_train_step(self, step: int, rollouts_key: str, scores_key: str,
                      prompts_key: str | None = None) -> dict[str, Any]:
        """One GRPO update from a scored rollout batch, publish the new version, checkpoint every K.

        The step's record (``train.json``, written once, before the checkpoint) says what was trained:
        :func:`batch_record` of the batch, with the prompt ids from ``prompts_key`` when given.

        Samples the scores mark ``masked`` (not scorable: sandbox infrastructure failures) are left out
        of their group's advantages, of the loss and of its token normaliser; a group with fewer than
        ``trainer.min_group_samples`` scored samples is dropped (:func:`~infra.train.grpo.plan_batch`)."""
        from infra.train.grpo import plan_batch

        behind = self._bc_settle()  # before anything changes: a failure here leaves the step to be retried
        done_key = run_key(self.run_id, step, "train.json")
        if step <= self.step:
            return get_json(self.store, done_key) if self.rank == 0 else {}
        if step != self.step + 1:
            raise StepOrderError(f"trainer is at step {self.step}; steps {self.step + 1}..{step - 1} "
                                 f"must be trained (replayed) before step {step}")
        t0 = time.perf_counter()
        rollouts = get_json(self.store, rollouts_key)
        scores = get_json(self.store, scores_key)
        samples = rollouts["samples"]
        if not samples:
            raise ValueError(f"step {step}: the rollout batch {rollouts_key} has no samples")
        rewards = torch.tensor(scores["rewards"], dtype=torch.float32)
        masked = torch.tensor(scores.get("masked") or [False] * len(rewards), dtype=torch.bool)
        plan = plan_batch(rewards, rollouts["group_size"], masked=masked.tolist(),
                          min_group_samples=self.cfg.trainer.min_group_samples, norm=self.cfg.trainer.advantage_norm)
        metrics, norm = self._grpo_update(rollouts.get("prompt_ids") or rollouts["prompts"], samples, plan)
        scored = rewards[~masked]  # the reward statistics of the samples that were scored
        self.step = step
        train_seconds = time.perf_counter() - t0
        publish = self._publish_next()
        result: dict[str, Any] = {}
        if self.rank == 0:
            if self.store.exists(done_key):  # replayed after a restart: the first record stands
                result = get_json(self.store, done_key)
            else:
                tokens = sum(len(s["token_ids"]) for s in samples)
                result = {
                    "step": step,
                    "metrics": {**metrics, "grad_norm": norm, "train_seconds": train_seconds,
                                "train_tokens_per_s": tokens * self.cfg.trainer.inner_epochs / max(train_seconds, 1e-9),
                                "reward_mean": float(scored.mean()) if len(scored) else 0.0,
                                "reward_std": float(scored.std()) if len(scored) > 1 else 0.0,
                                "masked_samples": float(plan.masked),
                                "masked_groups_dropped": float(plan.groups_dropped)},
                    "publish": publish,
                    **({"published_behind": behind} if behind else {}),  # the previous version's publish
                    **batch_record(rollouts, scores, get_json(self.store, prompts_key) if prompts_key else None),
                }
                put_json(self.store, done_key, result)  # before the checkpoint: a restored step has its record
        tcfg = self.cfg.trainer
        if step % tcfg.checkpoint_every == 0 or step == tcfg.steps:
            ckpt = self.op_checkpoint(step)
            if self.rank == 0:
                result = {**result, "checkpoint": ckpt}
                result["metrics"] = {**result.get("metrics", {}), "checkpoint_seconds": ckpt["seconds"]}
        return result

    def _grpo_update(self, prompts: list[str] | list[list[int]], samples: list[dict[str, Any]],
                     plan: "BatchPlan") -> tuple[dict[str, float], float]:
        """Collective: ``inner_epochs`` optimizer steps on this rank's rows; (metrics over all ranks, grad norm).

        Only the ``plan``'s trainable samples enter the batch and the token normaliser (masked ones and
        dropped groups never do); identical samples of one prompt train as one weighted row (same
        gradient, less compute), rows whose advantage is zero are not computed at all
        (:func:`~infra.train.grpo.select_rows`); the distinct rows are dealt to the ranks round-robin.
        Every rank runs the same number of micro-batches (FSDP/ZeRO-3 gather weights in each forward);
        a rank short of rows runs a zero-weight row instead."""
        from infra.train.grpo import build_batch, grpo_loss, loss_tokens, select_rows

        tcfg = self.cfg.trainer
        adv = plan.advantages
        keep, counts, skipped = select_rows(samples, adv, plan.trainable, tcfg.merge_duplicates, tcfg.kl_coef)
        mine = list(range(self.rank, len(keep), self.world))
        idx = [keep[j] for j in mine]
        weight = [float(counts[j]) for j in mine]
        total_tokens = loss_tokens(samples, plan.trainable)
        per_rank = -(-len(keep) // self.world)
        n_chunks = max(1, -(-per_rank // tcfg.micro_batch))
        metrics_acc: dict[str, float] = {}  # token-weighted sums (loss: plain sum), reduced over ranks below
        norm = 0.0
        for _epoch in range(tcfg.inner_epochs):
            for start in range(0, n_chunks * tcfg.micro_batch, tcfg.micro_batch):
                chunk = idx[start : start + tcfg.micro_batch]
                w = weight[start : start + tcfg.micro_batch]
                if not chunk:
                    chunk, w = [keep[0]], [0.0]
                batch = build_batch(self.tokenizer, [prompts[samples[i]["prompt_index"]] for i in chunk],
                                    [samples[i] for i in chunk], adv[chunk], w, positional=True)
                with self.engine.autocast():
                    loss, m = grpo_loss(
                        self.engine.module, batch, clip_eps=tcfg.clip_eps, clip_eps_high=tcfg.clip_eps_high,
                        kl_coef=tcfg.kl_coef, ref_model=self.ref_model, total_tokens=total_tokens / self.world,
                        temperature=self.cfg.rollout.temperature,
                    )
                self.engine.backward(loss)
                for k, v in m.items():
                    metrics_acc[k] = metrics_acc.get(k, 0.0) + float(v) * (1.0 if k in ("loss", "tokens") else m["tokens"])
            norm = self.engine.step()
        metrics = self._reduce_metrics(metrics_acc)
        metrics["rows_trained"] = float(len(keep) if any(counts) else 0)
        metrics["rows_skipped_zero_advantage"] = float(skipped)
        metrics["loss_tokens"] = total_tokens
        return metrics, norm

    def _reduce_metrics(self, acc: dict[str, float]) -> dict[str, float]:
        """Collective: sum the per-rank metric sums; token-weighted means, loss and tokens per inner epoch."""
        names = sorted(acc)
        local = torch.tensor([acc[k] for k in names], dtype=torch.float64)
        if self.world > 1 and local.numel():
            dist.all_reduce(local)
        sums = dict(zip(names, local.tolist()))
        tok = max(sums.get("tokens", 0.0), 1.0)
        metrics = {k: (v if k in ("loss", "tokens") else v / tok) for k, v in sums.items()}
        epochs = self.cfg.trainer.inner_epochs
        metrics["loss"] = sums.get("loss", 0.0) / epochs
        metrics["tokens"] = sums.get("tokens", 0.0) / epochs
        return metrics

    # ---------------------------------------------------------------------------------- export
    def op_export(self, path: str) -> dict[str, Any]:
        """Save the current policy (fp32, adapters merged) as a Hugging Face safetensors folder (rank 0)."""
        self._bc_settle()
        full = self._hf_state()
        if self.rank == 0:
            assert full is not None and self.model is not None
            model: Any = self.model
            if self.cfg.trainer.lora.enabled:
                model = self.model.get_base_model()  # type: ignore[operator]
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(str(out), state_dict={k: v.contiguous() for k, v in full.items()},
                                  safe_serialization=True)
            self.tokenizer.save_pretrained(str(out))
        return {"path": path, "step": self.step}

    def op_ping(self) -> dict[str, Any]:
        """Health probe: every rank answers through a collective."""
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"ranks": int(t.item()), "step": self.step, "weights_version": self.weights_version}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd.pop("op")
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise ValueError(f"unknown trainer op {op!r}")
        return fn(**cmd)


def _group_broken(exc: BaseException) -> bool:
    """True if ``exc`` means the process group itself failed (a peer died), not the command."""
    kinds = tuple(k for k in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistBackendError", None)) if k)
    if kinds and isinstance(exc, kinds):
        return True
    text = str(exc)
    return any(m in text for m in ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                                   "Broken pipe", "NCCL communicator was aborted"))


def main() -> None:
    """Rank entry point: join the group, then serve commands until ``shutdown``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", help="TrainerSpec JSON file (default: $DELTALOOP_SPEC).")
    args = parser.parse_args()
    spec = TrainerSpec.read(args.spec)
    cfg = spec.config
    torch.set_num_threads(cfg.cluster.threads_per_rank)
    exit_with_parent()
    dist.init_process_group(backend=cfg.cluster.backend)
    store = open_store(**spec.store.model_dump())
    trainer = Trainer(spec, store)
    from infra.gcpause import freeze_startup_objects

    freeze_startup_objects()  # later full GCs skip torch's ~170k import-time objects (~110 ms each)
    server = None
    if trainer.rank == 0:
        from infra.rpc import control_key, serve_listener

        bind = "127.0.0.1" if cfg.cluster.type == "local" else "0.0.0.0"
        server = serve_listener(store, spec.control_key, control_key(), bind)
    while True:
        # rank 0 waits for the flow's command; a controller that goes away may reconnect, and with
        # none for start_timeout_s (the flow's own wait for the group) the group shuts down
        box: list[Any] = [server.next_command(cfg.cluster.start_timeout_s) if server is not None else None]
        dist.broadcast_object_list(box, src=0)  # between ranks (trusted peers, see docs/security.md)
        cmd = dict(box[0])
        op = cmd.get("op")
        if op == "shutdown":
            trainer.bc_settle_quietly()
            if server is not None:
                server.reply({"ok": True})
            break
        try:
            reply = trainer.handle(cmd)
        except Exception as exc:  # report to the flow; the rank keeps serving
            if _group_broken(exc):  # a peer rank died: this group is over, let the flow restart it
                traceback.print_exc()
                os._exit(17)
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                     "retryable": is_retryable(exc)}
        if server is not None:
            server.reply(reply)
    if server is not None:
        server.close()
    if trainer.publisher is not None:  # abandons a background snapshot: nothing half-written stays visible
        trainer.publisher.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
