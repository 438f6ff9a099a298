"""Rollout engines: sample completions (tokens + log-probs) from the current policy version.

Select a backend with ``rollout.type`` through :func:`create_engine`. ``local`` is the torch
KV-cached sampler (:mod:`infra.rollout.local`); other backends (e.g. ``vllm``) register themselves
with :func:`register_engine` from their own module, imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from infra.rollout.engine import Completion, RolloutEngine, SamplingParams

if TYPE_CHECKING:
    from infra.config import RolloutConfig

EngineFactory = Callable[["RolloutConfig", Any, Any], RolloutEngine]
_ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Register ``factory(rollout_cfg, model, tokenizer)`` under ``name`` (``rollout.type``)."""
    _ENGINES[name] = factory


def _local(cfg: "RolloutConfig", model: Any, tokenizer: Any) -> RolloutEngine:
    from infra.rollout.local import LocalEngine

    return LocalEngine(model, tokenizer, max_batch=getattr(cfg, "max_batch", 256))


register_engine("local", _local)


def create_engine(cfg: "RolloutConfig", model: Any, tokenizer: Any) -> RolloutEngine:
    """The engine named by ``cfg.type`` serving ``model``; unknown names raise ``ValueError``."""
    import importlib

    if cfg.type not in _ENGINES:
        try:  # a backend module registers itself on import (e.g. infra/rollout/vllm_engine.py)
            importlib.import_module(f"infra.rollout.{cfg.type}_engine")
        except ModuleNotFoundError as exc:
            if exc.name != f"infra.rollout.{cfg.type}_engine":
                raise
    try:
        factory = _ENGINES[cfg.type]
    except KeyError:
        raise ValueError(f"unknown rollout engine {cfg.type!r}; known: {', '.join(sorted(_ENGINES))}") from None
    return factory(cfg, model, tokenizer)


__all__ = ["Completion", "RolloutEngine", "SamplingParams", "create_engine", "register_engine"]
