"""Build the environment an ``env`` config names, and check it before anything starts.

``env.type`` selects the builder (:data:`ENVIRONMENTS`, lazy: an environment's library is imported
only when it is chosen). :func:`check_environment` builds the environment and draws one item of
each split, turning every failure — an unknown reasoning-gym task, a missing column, an unreadable
or empty file, an entry point that does not import — into one line of the config error list; the
CLI and the flows call it right after the config validates, before any process starts.
"""

from __future__ import annotations

import importlib
import os
import sys

from evals.env import Environment
from infra.backends import Registry
from infra.config import ConfigError, EnvConfig, PythonEnvConfig, RunConfig

ENVIRONMENTS: Registry[Environment] = Registry("environment type", {
    "funcfit": "evals.funcfit:FuncfitEnv.from_config",
    "reasoning_gym": "evals.rgym:ReasoningGymEnv.from_config",
    "dataset": "evals.dataset:DatasetEnv.from_config",
    "humaneval": "evals.humaneval:HumanEvalEnv.from_config",
    "python": "evals.registry:build_python_env",
})


def build_environment(cfg: EnvConfig) -> Environment:
    """The environment ``cfg`` describes."""
    return ENVIRONMENTS.create(cfg.type, cfg)


_CACHE: dict[str, Environment] = {}


def cached_environment(cfg: EnvConfig) -> Environment:
    """:func:`build_environment`, built once per distinct config in this process (environments are
    deterministic in their config; building one may read a file or import a library)."""
    key = cfg.model_dump_json()
    if key not in _CACHE:
        _CACHE[key] = build_environment(cfg)
    return _CACHE[key]


def build_python_env(cfg: PythonEnvConfig) -> Environment:
    """``entry`` = ``module:factory``: import the module (``paths`` first on ``sys.path``), call
    ``factory(cfg)`` and check the result has the :class:`~evals.env.Environment` members."""
    for p in reversed(cfg.paths):
        if not os.path.isdir(p):
            raise ValueError(f"env.paths: {p!r} is not a folder (relative paths start at {os.getcwd()})")
        if p not in sys.path:
            sys.path.insert(0, p)
    module, _, attr = cfg.entry.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise ValueError(f"env.entry {cfg.entry!r}: module {module!r} does not import ({exc})") from None
    except AttributeError:
        raise ValueError(f"env.entry {cfg.entry!r}: module {module!r} has no attribute {attr!r}") from None
    env = factory(cfg)
    missing = [m for m in ("name", "stop", "system_prompt", "needs_sandbox", "train_items", "heldout_items", "score")
               if not hasattr(env, m)]
    if missing:
        raise ValueError(f"env.entry {cfg.entry!r} returned {type(env).__name__}, which lacks {', '.join(missing)} "
                         "(see evals/env.py: Environment)")
    return env


def check_environment(cfg: EnvConfig, prefix: str = "env") -> list[str]:
    """Problems with the environment ``cfg`` names, one line each (empty: it builds and yields items)."""
    try:
        env = build_environment(cfg)
        if not env.heldout_items(1):
            return [f"{prefix}: the held-out split is empty"]
        if getattr(env, "has_train_split", True) and not env.train_items(1, 1):
            return [f"{prefix}: the train split is empty"]
    except Exception as exc:  # any failure to build or draw is the user's input to fix: say it in one line
        msg = " ".join(str(exc).split()) or type(exc).__name__
        return [f"{prefix} ({cfg.type}): {msg}"]
    return []


def require_environments(cfg: RunConfig, source: str) -> None:
    """Raise :class:`~infra.config.ConfigError` (one line per problem) unless every environment of the
    run builds: called right after the config validates, before anything starts."""
    problems = check_run_environments(cfg)
    if problems:
        raise ConfigError(source, problems)


def check_run_environments(cfg: RunConfig) -> list[str]:
    """:func:`check_environment` for the run's env and every eval suite's own env."""
    problems = check_environment(cfg.env)
    if not problems and cfg.warmstart.steps > 0 and not hasattr(cached_environment(cfg.env), "sft_examples"):
        problems.append(f"warmstart.steps = {cfg.warmstart.steps}: environment type {cfg.env.type!r} has no "
                        "reference completions for a warm start; set warmstart.steps: 0")
    for suite in cfg.eval.suites:
        if suite.env is not None:
            problems += check_environment(suite.env, prefix=f"eval.suites[{suite.name}].env")
    return problems
