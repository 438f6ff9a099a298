"""A complete environment of your own, outside deltaloop: "reverse the word", scored by exact match.

Copy this folder, change the prompts and ``score``, and point a config at it (docs/environments.md)::

    env:
      type: python
      entry: my_env:make          # module:factory
      paths: [examples/my_env]    # folders put on sys.path first (relative to the current directory)
      options: {min_len: 3, max_len: 6}

``make(config)`` gets the whole ``env`` section (``config.seed``, ``config.eval_problems``,
``config.system_prompt``, ``config.stop``, ``config.options``) and returns an object with the
members of ``evals.env.Environment``: ``name``, ``stop``, ``system_prompt``, ``needs_sandbox``,
``train_items(step, n)``, ``heldout_items(n)`` and ``score(items, completions, pool)``.

The rules an environment keeps: items are deterministic in (seed, step); no held-out item is ever a
training item (here a word is held out when a hash of it says so, whichever list draws it); every
reward is in [0, 1]; the score of a completion depends only on the item and the completion. This
one executes nothing, so it needs no sandbox (``needs_sandbox = False``; ``pool`` is None).
"""

from __future__ import annotations

import hashlib
import random
import string
from typing import Any, Sequence

from evals.env import Item, Score, check_batch


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "big")


class ReverseWordEnv:
    """Prompt: a random lowercase word; answer: the word reversed (the first word of the reply)."""

    name = "reverse_word"
    needs_sandbox = False
    SYSTEM_PROMPT = "Reply with only the word, reversed."

    def __init__(self, seed: int = 1234, eval_problems: int = 200, min_len: int = 3, max_len: int = 6,
                 heldout_share: float = 0.2, system_prompt: str | None = None, stop: Sequence[str] = ()) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.seed, self.min_len, self.max_len, self.heldout_share = seed, min_len, max_len, heldout_share
        self.system_prompt = self.SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.stop = tuple(stop)
        self._heldout = self._draw(random.Random(_hash(seed, "heldout")), eval_problems, heldout=True)

    def _is_heldout(self, word: str) -> bool:
        return _hash(self.seed, "split", word) % 10_000 < self.heldout_share * 10_000

    def _draw(self, rng: random.Random, n: int, heldout: bool) -> list[str]:
        words: list[str] = []
        for _ in range(1000 * n):
            if len(words) == n:
                break
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(self.min_len, self.max_len)))
            if self._is_heldout(word) == heldout and (not heldout or word not in words):
                words.append(word)
        else:
            raise ValueError(f"could not draw {n} distinct words of {self.min_len}-{self.max_len} letters")
        return words

    def _item(self, word: str) -> Item:
        return Item(id=word, prompt=f"Reverse the word: {word}", answer=word[::-1])

    def heldout_items(self, n: int) -> list[Item]:
        """The first ``n`` held-out words (one fixed list per seed)."""
        return [self._item(w) for w in self._heldout[:n]]

    def train_items(self, step: int, n: int) -> list[Item]:
        """``n`` training words for ``step``, never held-out ones."""
        return [self._item(w) for w in self._draw(random.Random(_hash(self.seed, "train", step)), n, heldout=False)]

    def score(self, items: Sequence[Item], completions: Sequence[str], pool: Any = None) -> list[Score]:
        """1 when the reply's first word is the reversed word, else 0."""
        check_batch(items, completions)
        out = []
        for item, text in zip(items, completions):
            words = text.split()
            if not words:
                out.append(Score(0.0, False, "no_answer"))
                continue
            ok = words[0].strip(".,!\"'").lower() == item.answer
            out.append(Score(float(ok), ok, "ok" if ok else "wrong"))
        return out


def make(config: Any) -> ReverseWordEnv:
    """The factory ``env.entry`` names: build the environment from the ``env`` config section."""
    opts = dict(config.options)
    return ReverseWordEnv(seed=config.seed, eval_problems=config.eval_problems,
                          min_len=int(opts.get("min_len", 3)), max_len=int(opts.get("max_len", 6)),
                          heldout_share=float(opts.get("heldout_share", 0.2)),
                          system_prompt=config.system_prompt, stop=tuple(config.stop or ()))
