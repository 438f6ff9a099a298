"""reasoning_gym: any task of the ``reasoning-gym`` package, or a weighted mix, as an environment.

Each task is a procedural dataset (``reasoning_gym.create_dataset(name, seed=, size=, **config)``)
whose item ``i`` is a pure function of (seed, i, config). Two datasets per task, with seeds derived
from ``env.seed`` and the task name: the **held-out** one (walked in order for ``env.eval_problems``
distinct questions, in a fixed weighted interleaving of the tasks, so ``heldout_items(n)`` is always
a prefix of one list) and the **train** one (random indices drawn per step from a 2**31-item range). A train item whose question text equals
a held-out question is skipped, so the splits are disjoint even for easy tasks with few distinct
problems.

Scoring runs on the trusted side: the configured extraction rule (``env.answer.extract``, default
``<answer>…</answer>``) finds the answer and the task's own ``score_answer(answer, entry)`` grades
it, the entry regenerated from the item's (task, split, index). The reward is that grade, shaped by
``env.answer.format_weight``; an answer is correct when the grade is 1.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

from evals.answers import default_system_prompt, extract_answer, shaped_reward
from evals.env import Item, Score, check_batch, prompt_key, stable_hash

if TYPE_CHECKING:
    from infra.config import ReasoningGymEnvConfig
    from infra.sandbox import SandboxPool

TRAIN_SIZE = 2**31 - 1
MAX_REDRAWS = 1000


def _seed(*parts: object) -> int:
    """A 32-bit dataset seed from ``parts``."""
    return stable_hash(*parts) >> 32


@lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    import json

    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def make_dataset(name: str, seed: int, size: int, config: dict[str, Any]) -> Any:
    """The task's procedural dataset; errors name the task and say what is wrong with it."""
    import json

    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = sorted(n for n in DATASETS if name[:3] in n)[:5]
        raise ValueError(f"unknown reasoning_gym task {name!r}" + (f" (did you mean {', '.join(close)}?)" if close
                                                                    else f"; {len(DATASETS)} tasks exist"))
    try:
        return _dataset(name, seed, size, json.dumps(config, sort_keys=True))
    except (TypeError, AssertionError, ValueError) as exc:
        raise ValueError(f"reasoning_gym task {name!r}: bad config {config}: {exc}") from None


class ReasoningGymEnv:
    """Tasks of reasoning-gym mixed by weight; see the module docstring for splits and scoring."""

    name = "reasoning_gym"
    needs_sandbox = False

    def __init__(self, tasks: list[tuple[str, float, dict[str, Any]]], seed: int = 1234, heldout_size: int = 300,
                 extract: str = "answer_tag", format_weight: float = 0.0, system_prompt: str | None = None,
                 stop: tuple[str, ...] = ()) -> None:
        if not tasks:
            raise ValueError("reasoning_gym needs at least one task")
        self.tasks = [(n, float(w), dict(c)) for n, w, c in tasks]
        self.seed, self.heldout_size = seed, heldout_size
        self.extract, self.format_weight = extract, format_weight
        self.system_prompt = default_system_prompt(extract) if system_prompt is None else system_prompt
        self.stop = tuple(stop)
        for name, _, _ in self.tasks:  # fail now (preflight) on an unknown task or a bad config
            self._data(name, "heldout")[0]
        self._heldout_questions: set[str] = set()
        self._order = self._heldout_order(heldout_size)

    @classmethod
    def from_config(cls, cfg: "ReasoningGymEnvConfig") -> "ReasoningGymEnv":
        """From an ``env`` config section of type reasoning_gym."""
        return cls([(t.name, t.weight, t.config) for t in cfg.tasks], cfg.seed, cfg.eval_problems,
                   cfg.answer.extract, cfg.answer.format_weight, cfg.system_prompt,
                   tuple(cfg.stop) if cfg.stop is not None else ())

    # ------------------------------------------------------------------------------ splits
    def _data(self, task: str, split: str) -> Any:
        config = next(c for n, _, c in self.tasks if n == task)
        return make_dataset(task, _seed(self.seed, task, split), TRAIN_SIZE, config)

    def _heldout_order(self, n: int) -> list[tuple[str, int]]:
        """(task, index) of the held-out list: ``n`` distinct questions. Each slot goes to the task
        furthest below its weighted share so far (smooth weighted round-robin), so every prefix is
        mixed as the weights say; a task's held-out dataset is walked in order, skipping a question
        already on the list (easy tasks repeat themselves), so the held-out problems are all different."""
        total = sum(w for _, w, _ in self.tasks)
        counts = {t: 0 for t, _, _ in self.tasks}
        cursor = {t: 0 for t, _, _ in self.tasks}
        out: list[tuple[str, int]] = []
        for k in range(n):
            task = max(self.tasks, key=lambda t: (k + 1) * t[1] / total - counts[t[0]])[0]
            data = self._data(task, "heldout")
            for _attempt in range(MAX_REDRAWS):
                index = cursor[task]
                cursor[task] += 1
                question = prompt_key(str(data[index]["question"]))
                if question not in self._heldout_questions:
                    break
            else:
                raise ValueError(f"reasoning_gym task {task!r} has fewer than {counts[task] + 1} distinct problems "
                                 f"for its share of env.eval_problems = {n}; lower it or widen the task's config")
            self._heldout_questions.add(question)
            out.append((task, index))
            counts[task] += 1
        return out

    def _item(self, task: str, split: str, index: int) -> Item:
        entry = self._data(task, split)[index]
        return Item(id=f"{task}|{split}|{index}", prompt=str(entry["question"]), answer=str(entry["answer"]),
                    group=task, data={"task": task, "split": split, "index": index})

    def heldout_items(self, n: int) -> list[Item]:
        """The first ``n`` held-out items (at most ``env.eval_problems``)."""
        return [self._item(t, "heldout", i) for t, i in self._order[: min(n, len(self._order))]]

    def train_items(self, step: int, n: int) -> list[Item]:
        """``n`` training items for ``step``: tasks drawn by weight, indices at random, no held-out question."""
        rng = random.Random(_seed(self.seed, "train-step", step))
        names, weights = [t for t, _, _ in self.tasks], [w for _, w, _ in self.tasks]
        held = self._heldout_questions
        out: list[Item] = []
        for _ in range(n):
            task = rng.choices(names, weights)[0]
            for _attempt in range(MAX_REDRAWS):
                item = self._item(task, "train", rng.randrange(TRAIN_SIZE))
                if prompt_key(str(item.prompt)) not in held:
                    break
            else:
                raise ValueError(f"reasoning_gym task {task!r}: {MAX_REDRAWS} draws in a row repeat held-out "
                                 "questions; the task has too few distinct problems for this held-out size")
            out.append(item)
        return out

    # ----------------------------------------------------------------------------- scoring
    def _dataset_and_entry(self, item: Item) -> tuple[Any, dict[str, Any]]:
        d = item.data
        data = self._data(str(d["task"]), str(d["split"]))
        return data, data[int(d["index"])]

    def entry(self, item: Item) -> dict[str, Any]:
        """The package's entry of ``item`` (regenerated: items carry only their task, split and index)."""
        return self._dataset_and_entry(item)[1]

    def score(self, items: Sequence[Item], completions: Sequence[str],
              pool: "SandboxPool | None" = None) -> list[Score]:
        """Extract each answer and grade it with its task's ``score_answer`` (each item's entry is
        regenerated once per batch, however many samples answer it)."""
        check_batch(items, completions)
        entries: dict[str, tuple[Any, dict[str, Any]]] = {}
        out: list[Score] = []
        for item, text in zip(items, completions):
            answer = extract_answer(text, self.extract)
            if answer is None:
                out.append(Score(shaped_reward(False, False, self.format_weight), False, "no_answer"))
                continue
            if item.id not in entries:
                entries[item.id] = self._dataset_and_entry(item)
            data, entry = entries[item.id]
            grade = min(1.0, max(0.0, float(data.score_answer(answer=answer, entry=entry) or 0.0)))
            correct = grade >= 1.0
            out.append(Score((1.0 - self.format_weight) * grade + self.format_weight, correct,
                             "ok" if correct else "wrong"))
        return out
