"""A reward of your own on a built-in environment's problems: reasoning-gym prompts, graded by the
package, with a length penalty on top (short, correct answers score highest).

The pattern: build the built-in environment from a section of ``env.options``, forward its splits,
and change only ``score``. Config (docs/environments.md)::

    env:
      type: python
      entry: my_reward:make
      paths: [examples/my_env]
      options:
        max_chars: 200
        inner: {type: reasoning_gym, tasks: [{name: chain_sum, config: {min_terms: 2, max_terms: 3}}]}
"""

from __future__ import annotations

from typing import Any, Sequence

from evals.env import Environment, Item, Score, check_batch
from evals.registry import build_environment
from infra.config import ReasoningGymEnvConfig


class ShortAnswers:
    """The inner environment's items and grade, times ``min(1, max_chars / len(completion))``."""

    name = "short_answers"

    def __init__(self, inner: Environment, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.inner, self.max_chars = inner, max_chars
        self.stop, self.system_prompt = inner.stop, inner.system_prompt
        self.needs_sandbox = inner.needs_sandbox

    def train_items(self, step: int, n: int) -> list[Item]:
        """The inner environment's training items."""
        return self.inner.train_items(step, n)

    def heldout_items(self, n: int) -> list[Item]:
        """The inner environment's held-out items."""
        return self.inner.heldout_items(n)

    def score(self, items: Sequence[Item], completions: Sequence[str], pool: Any = None) -> list[Score]:
        """The inner grade, scaled down for completions longer than ``max_chars`` (correctness unchanged)."""
        check_batch(items, completions)
        graded = self.inner.score(items, completions, pool)
        return [Score(s.reward * min(1.0, self.max_chars / max(1, len(c))), s.correct, s.reason)
                for s, c in zip(graded, completions)]


def make(config: Any) -> ShortAnswers:
    """Factory for ``env.entry``: ``options.inner`` is a reasoning_gym env section, ``options.max_chars``
    the length above which the reward shrinks. The outer ``seed`` and ``eval_problems`` apply."""
    inner = dict(config.options.get("inner") or {})
    if inner.get("type", "reasoning_gym") != "reasoning_gym":
        raise ValueError("options.inner must be a reasoning_gym env section")
    inner_cfg = ReasoningGymEnvConfig.model_validate(
        {**inner, "type": "reasoning_gym", "seed": config.seed, "eval_problems": config.eval_problems})
    return ShortAnswers(build_environment(inner_cfg), int(config.options.get("max_chars", 200)))
