"""The rollout engine interface: what a sampler must offer the RL loop.

``generate`` returns, for every prompt, ``n`` completions grouped by prompt (prompt 0's n samples
first), each with the sampled token ids and the per-token log-probs under the policy that produced
them — GRPO's "old" log-probs for the importance ratio. ``load_weights`` swaps in a synced policy
version in place; ``version`` reports the one being served, and each completion records it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from infra.rollout.errors import BadRequest


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature`` 0 is greedy. ``stop`` strings end a completion (not included
    in ``text``; the token that completed them is kept in ``token_ids``). ``seed`` makes sampling
    reproducible per request: sample j of prompt i uses a stream derived from (seed, i, j) only,
    so results do not depend on batch composition."""

    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=lambda: ["\n"])
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def check_request(prompt_ids: list[list[int]], n: int, vocab_size: int | None = None,
                  max_positions: int | None = None, max_new_tokens: int = 0) -> None:
    """The request rules every engine enforces before admitting a row: ``n >= 1``, no empty prompt,
    every token id an int in ``[0, vocab_size)``, and each prompt plus ``max_new_tokens`` within
    ``max_positions``. A violation raises :class:`~infra.rollout.errors.BadRequest` naming the
    prompt; nothing of the request has been queued then, so it cannot disturb other requests."""
    if n < 1:
        raise BadRequest(f"n must be >= 1, got {n}")
    for i, p in enumerate(prompt_ids):
        if not p:
            raise BadRequest("every prompt must have at least one token")
        if any(type(t) is not int for t in p):  # bool and float are not token ids
            raise BadRequest(f"prompt {i}: token ids must be integers")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            bad = next(t for t in p if not 0 <= t < vocab_size)
            raise BadRequest(f"prompt {i}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        if max_positions is not None and len(p) + max_new_tokens > max_positions:
            raise BadRequest(f"prompt {i}: {len(p)} tokens plus max_new_tokens {max_new_tokens} exceed the "
                             f"model's {max_positions} positions")


def encode_prompts(tokenizer: object, prompts: list[str]) -> list[list[int]]:
    """Token ids of plain-text prompts, with the tokenizer's special tokens (bos) added."""
    return tokenizer(list(prompts), add_special_tokens=True)["input_ids"]  # type: ignore[operator]


@dataclass
class Completion:
    """One sampled completion. ``logprobs[k]`` is log p(token_ids[k]) under the sampling
    distribution (logits / temperature; raw logits when greedy). ``finish_reason``: ``stop``
    (eos or a stop string) or ``length``."""

    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """A policy sampler serving one weight version at a time."""

    version: int

    def generate(self, prompts: list[str], n: int, params: SamplingParams) -> list[Completion]:
        """``n`` completions per plain-text prompt, grouped by prompt (len = len(prompts) * n)."""
        ...

    def generate_ids(self, prompt_ids: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        """Like :meth:`generate` for prompts already rendered to token ids (:func:`infra.model.render_prompts`)."""
        ...

    def load_weights(self, tensors: dict, version: int) -> None:
        """Replace the served weights (names as in ``infra.model.publishable_state``)."""
        ...
