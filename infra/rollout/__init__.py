"""Rollout engines: sample completions (tokens + log-probs) from the current policy version.

Select a backend with ``rollout.type`` through :func:`create_engine`: ``local`` is the torch
KV-cached sampler (:mod:`infra.rollout.local`), ``vllm`` the vLLM engine
(:mod:`infra.rollout.vllm_engine`; vLLM must be importable, i.e. in vLLM's own environment). Both
are listed in :data:`ENGINES` and imported only when chosen; :func:`register_engine` adds another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from infra.backends import Registry
from infra.rollout.engine import Completion, RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from infra.config import RolloutConfig

EngineFactory = Callable[["RolloutConfig", Any, Any], RolloutEngine]


def _local(cfg: "RolloutConfig", model: Any, tokenizer: Any) -> RolloutEngine:
    from infra.rollout.local import LocalEngine

    return LocalEngine(model, tokenizer, max_batch=cfg.max_batch, stop_cache_entries=cfg.stop_cache_entries)


def _vllm(cfg: "RolloutConfig", model: Any, tokenizer: Any) -> RolloutEngine:
    from infra.rollout.vllm_engine import start_engine_sync

    return start_engine_sync(model, tokenizer, cfg)


ENGINES: Registry[RolloutEngine] = Registry("rollout engine", {"local": _local, "vllm": _vllm})


def register_engine(name: str, factory: EngineFactory | str) -> None:
    """Register ``factory(rollout_cfg, model, tokenizer)`` (or a lazy ``"module:attr"``) under ``name``."""
    ENGINES.add(name, factory)


def create_engine(cfg: "RolloutConfig", model: Any, tokenizer: Any) -> RolloutEngine:
    """The engine named by ``cfg.type`` serving ``model``; unknown names raise ``ValueError``."""
    return ENGINES.create(cfg.type, cfg, model, tokenizer)


__all__ = ["ENGINES", "Completion", "RolloutEngine", "SamplingParams", "create_engine", "register_engine"]
