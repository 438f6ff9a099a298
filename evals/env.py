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
  comparisons (string, number, math expression) run here, on the trusted side.

Items cross process boundaries as JSON (the per-step prompts artefact in the object store), so an
environment keeps whatever it needs to score an item in ``Item.data`` (JSON values) or can rebuild it
from ``Item.id``. ``Item.group`` names a slice of the split (a funcfit family, a reasoning-gym task)
for per-group reports and the promotion gate's guards.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, Union, runtime_checkable

if TYPE_CHECKING:
    from infra.sandbox import SandboxPool

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
    (counts toward accuracy) and ``reason`` (``ok``, ``wrong``, ``no_answer``, a sandbox reason...)."""

    reward: float
    correct: bool
    reason: str

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1], got {self.reward}")


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
