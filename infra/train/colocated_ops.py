"""Trainer ops of the ``colocated`` weight placement (mixed into :class:`infra.train.worker.Trainer`).

With ``weight_sync.placement: colocated`` there is no rollout worker and no weight sync: every
trainer rank samples with a :class:`~infra.rollout.local.LocalEngine` built on the rank's own policy
module (``self.model``, the parameters the optimizer updates in place). The engine holds no second
copy of the model: it reads the parameters where they are; the slot runner derives its fused q/k/v
and gate/up matrices from them once per version (detected by the parameters' version counters), a
concatenation inside the rank, not a transfer.

A rollout batch is split across the ranks in contiguous prompt slices (rank r takes prompts
``[P*r//W, P*(r+1)//W)``); every sample keeps the stream of its place in the whole batch
(:func:`~infra.rollout.local.row_seed` of its global prompt index), so the samples do not depend on
the number of ranks up to float rounding of different batch shapes. Rank 0 gathers the slices and
writes the rollouts object with the rollout worker's writer (:func:`infra.rollout.batch.write_rollouts`:
samples with token ids, log-probs and version, ``tokens``, ``seconds``), plus ``placement`` and
``ranks`` (which rank generated which prompts, and its seconds).

A "published" version is the trainer's own step counter: :meth:`ColocatedOps._colocated_publish`
bumps ``weights_version`` and writes nothing (the rollout engine reads these very parameters).
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from infra.errors import DeltaloopError
from infra.storage import get_json


class VersionMismatch(DeltaloopError):
    """A colocated rollout asked for a weights version the ranks do not hold (not retryable)."""

    retryable = False


def prompt_slice(total: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous prompt range ``[lo, hi)`` rank ``rank`` of ``world`` generates (balanced)."""
    return total * rank // world, total * (rank + 1) // world


class ColocatedOps:
    """Ops a trainer rank runs for ``weight_sync.placement: colocated``."""

    # set by infra.train.worker.Trainer
    cfg: Any
    store: Any
    run_id: str
    rank: int
    world: int
    step: int
    weights_version: int
    model: Any
    tokenizer: Any
    _colocated_engine: Any = None

    def _colocated_publish(self) -> dict[str, Any]:
        """The next weights version without any copy or write: the record a publish returns, zero bytes."""
        self.weights_version += 1
        return {"version": self.weights_version, "kind": "colocated", "bytes_written": 0, "raw_bytes": 0,
                "encode_seconds": 0.0, "seconds": 0.0, "changed_fraction": None}

    def op_colocated_version(self) -> dict[str, Any]:
        """The weights version (and step) these ranks hold: what a colocated rollout samples with."""
        return {"version": self.weights_version, "step": self.step}

    def _colocated_engine_for(self) -> Any:
        """The rank's sampler over its own policy module, made on first use (the model stays in train mode)."""
        if self._colocated_engine is None:
            from infra.rollout.local import LocalEngine

            rc = self.cfg.rollout
            self._colocated_engine = LocalEngine(self.model, self.tokenizer, max_batch=rc.max_batch,
                                                 stop_cache_entries=rc.stop_cache_entries)
            self.model.train()  # LocalEngine puts the model in eval mode; it is switched per batch
        return self._colocated_engine

    def op_colocated_rollout(self, prompts_key: str, out_key: str, n: int, temperature: float,
                             max_new_tokens: int, seed: int, version: int | None = None) -> dict[str, Any]:
        """Collective: generate ``n`` samples per prompt of ``prompts_key``, this rank its slice; rank 0
        writes ``out_key`` and answers like the rollout worker's ``/v1/rollout``. ``version``: the
        weights version the flow synced last (refused with :class:`VersionMismatch` if the ranks
        hold another one; None: no check).

        The request is checked on every rank before any generation (the same keys and prompts on
        all ranks, so all refuse alike); a failure while generating is gathered and raised on every
        rank after the gather, so no rank is left waiting in a collective."""
        from infra.model import render_prompts
        from infra.rollout.engine import SamplingParams, check_request
        from infra.rollout.guard import check_rollout_key
        from infra.rollout.batch import prompt_batch

        if version is not None and version != self.weights_version:
            raise VersionMismatch(f"colocated rollout asked for weights version {version}; the trainer ranks hold "
                                  f"version {self.weights_version}")
        check_rollout_key(self.run_id, prompts_key, "prompts_key")
        check_rollout_key(self.run_id, out_key, "out_key")
        prompts, render, stop = prompt_batch(get_json(self.store, prompts_key), prompts_key)
        prompt_ids = render_prompts(self.tokenizer, prompts, render["chat"], render.get("system_prompt"))
        engine = self._colocated_engine_for()
        runner = getattr(engine, "_runner", None)
        check_request(prompt_ids, n, engine.vocab_size, runner.max_position if runner is not None else None,
                      max_new_tokens)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=self.cfg.rollout.top_p, stop=stop, seed=seed)
        lo, hi = prompt_slice(len(prompts), self.rank, self.world)
        version = self.weights_version
        t0 = time.perf_counter()
        part = self._generate_slice(engine, prompt_ids, lo, hi, n, params, version)
        parts: list[Any] = [part]
        if self.world > 1:
            parts = [None] * self.world if self.rank == 0 else []
            dist.gather_object(part, parts if self.rank == 0 else None, dst=0)
            failed = [0 if self.rank != 0 else int(any(p["error"] for p in parts))]
            dist.broadcast_object_list(failed, src=0)
            if failed[0] and not part["error"]:
                raise RuntimeError("colocated rollout failed on another trainer rank (its error is on rank 0)")
        if part["error"]:
            raise RuntimeError(f"colocated rollout on trainer rank {self.rank}: {part['error']}")
        if self.rank == 0:
            return self._write_rollouts(out_key, parts, prompts, prompt_ids, n, version, time.perf_counter() - t0)
        return {}

    def _generate_slice(self, engine: Any, prompt_ids: list[list[int]], lo: int, hi: int, n: int, params: Any,
                        version: int) -> dict[str, Any]:
        """This rank's samples of prompts ``[lo, hi)`` (global prompt indices and streams), or its error."""
        from infra.rollout.batch import sample_records

        started = time.perf_counter()
        samples: list[dict[str, Any]] = []
        error = None
        if hi > lo:
            self.model.eval()
            try:
                samples = sample_records(engine.generate_ids(prompt_ids[lo:hi], n, params, first_prompt=lo), version)
            except Exception as exc:  # noqa: BLE001 - gathered, then raised on every rank
                error = f"{type(exc).__name__}: {exc}"
            finally:
                self.model.train()
        return {"rank": self.rank, "prompts": [lo, hi], "samples": samples, "error": error,
                "seconds": time.perf_counter() - started}

    def _write_rollouts(self, out_key: str, parts: list[dict[str, Any]], prompts: list[Any],
                        prompt_ids: list[list[int]], n: int, version: int, seconds: float) -> dict[str, Any]:
        """Rank 0: the rollouts object of the whole batch (the worker's fields plus who generated what)."""
        from infra.rollout.batch import write_rollouts

        parts = sorted(parts, key=lambda p: p["prompts"][0])  # contiguous slices: prompt order
        ranks = [{"rank": p["rank"], "prompts": p["prompts"], "samples": len(p["samples"]), "seconds": p["seconds"]}
                 for p in sorted(parts, key=lambda p: p["rank"])]
        answer = write_rollouts(self.store, out_key, version=version, n=n, prompts=prompts, prompt_ids=prompt_ids,
                                samples=[s for p in parts for s in p["samples"]], seconds=seconds,
                                placement="colocated", ranks=ranks)
        return {**answer, "ranks": ranks}
