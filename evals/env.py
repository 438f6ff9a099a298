"""The environment interface: where prompts come from and how completions are scored.

Every task the pipeline trains or evaluates on — the funcfit demo, reasoning-gym generators, a file
of questions with answers, HumanEval, the user's own — is an :class:`Environment`:

* **splits**: :meth:`~Environment.train_items` (``n`` items for a training step, deterministic in
  the environment's seed and the step) and :meth:`~Environment.heldout_items` (the first ``n`` of a
  fixed held-out list, deterministic in the seed). The two are disjoint by construction: an
  environment never returns a held-out item for training.
* **prompts**: an :class:`Item`'s ``prompt`` is plain text or a list of chat messages
  (``{"role", "content"}``); the rollout worker renders it for the model
  (:func:`infra.model.render_prompts`: the tokenizer's chat template when it has one).
* **scoring**: :meth:`~Environment.score` turns a batch of completions into one :class:`Score` each:
  a reward in [0, 1], whether the answer is fully correct, and a reason. Scorers that *execute*
  model output do it in the sandbox pool (passed in; the host alone compares results); pure
  comparisons (string, number, math expression) run here, on the trusted side. A sample whose
  sandbox infrastructure failed on every retry is not a score: its :class:`Score` is ``masked``
  (:func:`unscored`), and training and evaluation leave it out instead of counting a fake 0.

Items cross process boundaries as JSON (the per-step prompts artefact in the object store), so an
environment keeps whatever it needs to score an item in ``Item.data`` (JSON values) or can rebuild it
from ``Item.id``. ``Item.group`` names a slice of the split (a funcfit family, a reasoning-gym task)
for per-group reports and the promotion gate's guards.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, Union, runtime_checkable

from infra.errors import DeltaloopError

if TYPE_CHECKING:
    from infra.sandbox import SandboxPool
    from infra.sandbox.types import ExecResult, TestsResult, VerifyResult

Message = dict[str, str]
Prompt = Union[str, list[Message]]


@dataclass(frozen=True)
class Item:
    """One problem. ``answer`` is the reference answer as text (reports, warm start, the
    best-constant baseline; "" when there is none); ``data`` holds JSON values the scorer needs."""

    id: str
    prompt: Prompt
    answer: str = ""
    group: str = ""
    data: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_json(self) -> dict[str, Any]:
        """JSON-able form (stored in the per-step prompts artefact)."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Item":
        """Inverse of :meth:`to_json`."""
        return cls(id=str(d["id"]), prompt=d["prompt"], answer=str(d.get("answer", "")),
                   group=str(d.get("group", "")), data=dict(d.get("data") or {}))


@dataclass(frozen=True)
class Score:
    """The verdict on one completion: ``reward`` in [0, 1] (the training signal), ``correct``
    (counts toward accuracy) and ``reason`` (``ok``, ``wrong``, ``no_answer``, a sandbox reason...).

    ``masked``: the completion could not be scored (the sandbox or its runtime failed for reasons
    outside the job, on every retry). Its reward is 0.0 and means nothing: training leaves it out of
    the loss and of its group's advantage statistics, evaluations out of their means. A job that
    failed by itself (timeout, memory, crash) is a real score, never masked."""

    reward: float
    correct: bool
    reason: str
    masked: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1], got {self.reward}")
        if self.masked and (self.reward != 0.0 or self.correct):
            raise ValueError(f"a masked score has reward 0.0 and is not correct, got {self.reward}, {self.correct}")


def unscored() -> Score:
    """The Score of a sample the sandbox infrastructure could not score (reason ``infra``, masked)."""
    return Score(0.0, False, "infra", masked=True)


def infra_failed(result: "ExecResult | VerifyResult | TestsResult") -> bool:
    """Whether a sandbox result says the sandbox or its runtime failed on every attempt
    (``infra=True``): the sample gets :func:`unscored`, not the result's 0."""
    return bool(result.infra)


class UnscoredBatch(DeltaloopError):
    """Too many samples of a batch could not be scored (sandbox infrastructure failures): training on
    the rest would learn from a damaged batch. Retryable: a fresh attempt scores the batch again."""

    retryable = True


def check_unscored(scores: Sequence[Score], bound: float, what: str) -> float:
    """The share of masked ``scores``; raises :class:`UnscoredBatch` (one line: count, rate, bound, the
    reasons of the masked samples) when it exceeds ``bound``."""
    masked = [s for s in scores if s.masked]
    rate = len(masked) / max(1, len(scores))
    if rate > bound:
        reasons: dict[str, int] = {}
        for s in masked:
            reasons[s.reason] = reasons.get(s.reason, 0) + 1
        why = ", ".join(f"{k} x{v}" for k, v in sorted(reasons.items()))
        raise UnscoredBatch(f"{what}: {len(masked)}/{len(scores)} samples ({rate:.1%}) could not be scored "
                            f"(sandbox infrastructure failures: {why}), above loop.max_infra_failure_rate={bound}")
    return rate


@runtime_checkable
class Environment(Protocol):
    """A task: deterministic disjoint splits, prompts, and a batch scorer.

    ``stop``: strings that end a sampled completion by default (``()``: end of sequence only).
    ``system_prompt``: the system message chat-rendered prompts get by default (``None``: none).
    ``needs_sandbox``: whether :meth:`score` runs model output (then it must get a pool).
    """

    name: str
    stop: tuple[str, ...]
    system_prompt: str | None
    needs_sandbox: bool

    def train_items(self, step: int, n: int) -> list[Item]:
        """``n`` training items for ``step``, deterministic in (seed, step), never held-out ones."""
        ...

    def heldout_items(self, n: int) -> list[Item]:
        """The first ``n`` items of the held-out split (deterministic in the seed)."""
        ...

    def score(self, items: Sequence[Item], completions: Sequence[str],
              pool: "SandboxPool | None") -> list[Score]:
        """One :class:`Score` per completion; ``completions[i]`` answers ``items[i]``."""
        ...


def stable_hash(*parts: object) -> int:
    """A 64-bit number from ``parts``, the same on every machine and run (splits and orders are
    functions of it, never of Python's salted ``hash``)."""
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "big")


def prompt_key(prompt: Prompt) -> str:
    """A prompt's text with whitespace collapsed: two items with the same key are the same question,
    which the train split must not repeat from the held-out one."""
    text = prompt if isinstance(prompt, str) else "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
    return " ".join(text.split())


def check_batch(items: Sequence[Item], completions: Sequence[str]) -> None:
    """The rule every scorer enforces: one completion per item."""
    if len(items) != len(completions):
        raise ValueError(f"{len(items)} items but {len(completions)} completions")


def need_pool(env_name: str, pool: "SandboxPool | None") -> "SandboxPool":
    """``pool``, or a clear error: scorers that execute model output never run it in this process."""
    if pool is None:
        raise ValueError(f"environment {env_name!r} executes model output and needs a sandbox pool")
    return pool


def sft_examples_of(env: Environment, seed: int, n: int) -> list[tuple[str, str]]:
    """Supervised (prompt, target) pairs for the warm start, if the environment offers them.

    An environment opts in with a ``sft_examples(seed, n)`` method (funcfit does: its generated
    solutions); others raise a clear error, since a warm start needs reference completions."""
    fn = getattr(env, "sft_examples", None)
    if fn is None:
        raise ValueError(f"environment {env.name!r} has no reference completions for a warm start; "
                         "set warmstart.steps: 0")
    return list(fn(seed, n))
