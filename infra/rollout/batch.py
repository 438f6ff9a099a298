"""The rollout batch documents in the object store: the prompt batch a rollout reads and the
rollouts object it writes, one definition for every generator (the rollout worker,
:mod:`infra.rollout.server`, and the trainer ranks of the colocated placement,
:mod:`infra.train.colocated_ops`), so the trainer reads the same fields whoever sampled."""

from __future__ import annotations

from typing import Any, Iterable

from infra.rollout.engine import Completion
from infra.rollout.errors import BadRequest
from infra.storage import ObjectStore, put_json


def prompt_batch(batch: Any, key: str) -> tuple[list[Any], dict[str, Any], list[str]]:
    """The prompts, render settings and stop strings of a prompt batch document, or
    :class:`BadRequest` naming what is malformed (the document comes from the store)."""
    if not isinstance(batch, dict) or not isinstance(batch.get("prompts"), list) or not batch["prompts"]:
        raise BadRequest(f"{key}: 'prompts' must be a non-empty list")
    render = batch.get("render") or {"chat": "off", "system_prompt": None}
    if not isinstance(render, dict) or "chat" not in render:
        raise BadRequest(f"{key}: 'render' must be an object with 'chat'")
    stop = batch.get("stop", ["\n"])
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise BadRequest(f"{key}: 'stop' must be a list of strings")
    return batch["prompts"], render, list(stop)


def sample_records(completions: Iterable[Completion], version: int) -> list[dict[str, Any]]:
    """The stored form of sampled completions, each tagged with the weights ``version`` that made it."""
    return [{"prompt_index": c.prompt_index, "text": c.text, "token_ids": list(c.token_ids),
             "logprobs": [float(x) for x in c.logprobs], "finish_reason": c.finish_reason, "version": version}
            for c in completions]


def write_rollouts(store: ObjectStore, out_key: str, *, version: int, n: int, prompts: list[Any],
                   prompt_ids: list[list[int]], samples: list[dict[str, Any]], seconds: float,
                   **extra: Any) -> dict[str, Any]:
    """Write the rollouts object at ``out_key`` (``extra``: fields a generator adds, e.g. who made
    what) and return the answer of a rollout call: key, version, counts, seconds, throughput."""
    tokens = sum(len(s["token_ids"]) for s in samples)
    put_json(store, out_key, {"version": version, "group_size": n, "prompts": prompts, "prompt_ids": prompt_ids,
                              "samples": samples, "seconds": seconds, "tokens": tokens, **extra})
    return {"key": out_key, "version": version, "samples": len(samples), "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}
