"""A test environment whose scorer cannot score a seeded subset of samples (masked Scores).

Used through the ``python`` environment type (``env.entry: masked_env:make``, ``env.paths:
[tests/envs]``) by the tests of masked samples (issue #16): it stands in for an environment whose
sandbox infrastructure failed on some samples after every retry, without needing a sandbox. Which
samples are masked is a function of (seed, item, completion), so a run is reproducible and identical
completions of one prompt get the same verdict.

Rewards are a deterministic pseudo-random function of (seed, item, completion) in {0, .25, .5, .75,
1}: meaningless as a task, but they vary within a group, so GRPO has non-zero advantages to train on.

Options (``env.options``): ``mask_fraction`` (share of samples masked, default 0.25), ``min_len`` /
``max_len`` of the words in the prompts.
"""

from __future__ import annotations

import random
import string
from typing import Any, Sequence

from evals.env import Item, Score, check_batch, stable_hash


class MaskedEnv:
    """Prompts "Reverse the word: w"; pseudo-random rewards; a seeded share of samples masked."""

    name = "masked_test"
    needs_sandbox = False
    stop: tuple[str, ...] = ()
    system_prompt: str | None = None

    def __init__(self, seed: int = 0, eval_problems: int = 8, mask_fraction: float = 0.25, min_len: int = 3,
                 max_len: int = 6) -> None:
        if not 0.0 <= mask_fraction <= 1.0:
            raise ValueError(f"mask_fraction must be in [0, 1], got {mask_fraction}")
        self.seed, self.mask_fraction, self.min_len, self.max_len = seed, mask_fraction, min_len, max_len
        self._heldout = self._words(random.Random(stable_hash(seed, "heldout")), eval_problems, heldout=True)

    def _is_heldout(self, word: str) -> bool:
        return stable_hash(self.seed, "split", word) % 5 == 0

    def _words(self, rng: random.Random, n: int, heldout: bool) -> list[str]:
        words: list[str] = []
        while len(words) < n:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(self.min_len, self.max_len)))
            if self._is_heldout(word) == heldout and word not in words:
                words.append(word)
        return words

    def _item(self, word: str) -> Item:
        return Item(id=word, prompt=f"Reverse the word: {word}", answer=word[::-1])

    def train_items(self, step: int, n: int) -> list[Item]:
        """``n`` training words for ``step`` (never held-out ones)."""
        return [self._item(w) for w in self._words(random.Random(stable_hash(self.seed, "train", step)), n, False)]

    def heldout_items(self, n: int) -> list[Item]:
        """The first ``n`` held-out words."""
        return [self._item(w) for w in self._heldout[:n]]

    def is_masked(self, item: Item, completion: str) -> bool:
        """Whether this sample stands for one whose scoring infrastructure failed."""
        return stable_hash(self.seed, "mask", item.id, completion) % 10_000 < self.mask_fraction * 10_000

    def reward(self, item: Item, completion: str) -> float:
        """The sample's pseudo-random reward in {0, 0.25, 0.5, 0.75, 1}."""
        return (stable_hash(self.seed, "reward", item.id, completion) % 5) / 4

    def score(self, items: Sequence[Item], completions: Sequence[str], pool: Any = None) -> list[Score]:
        """A masked Score (reason ``infra``) for the seeded subset, the pseudo-random reward otherwise."""
        check_batch(items, completions)
        out = []
        for it, c in zip(items, completions):
            if self.is_masked(it, c):
                out.append(Score(0.0, False, "infra", masked=True))
            else:
                r = self.reward(it, c)
                out.append(Score(r, r >= 1.0, "ok" if r >= 1.0 else "wrong"))
        return out


def make(config: Any) -> MaskedEnv:
    """The ``python`` environment factory: ``config`` is the run's ``env`` section."""
    opts = dict(config.options)
    return MaskedEnv(seed=config.seed, eval_problems=config.eval_problems,
                     mask_fraction=float(opts.get("mask_fraction", 0.25)),
                     min_len=int(opts.get("min_len", 3)), max_len=int(opts.get("max_len", 6)))
