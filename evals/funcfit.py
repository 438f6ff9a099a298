"""funcfit: "write a Python expression in x from its values at x = 0..5".

The RL demo environment. Each problem is a function from one of a few families (``x+b``, ``b-x``,
``x*x+b``, ``a*x+b``, ``x%a+b``) with constants drawn fresh; the prompt shows its values at x = 0..5
and the policy answers with an expression in ``x``. The verifier (run in a sandbox by the pipeline)
calls ``f(x)`` on *hidden* points x = 6, 7, ... and the reward is the fraction that match — shown
points are not tested, so copying them earns nothing.

Why this shape: the space of functions (~2,100; ~600 held out) is too large for a 1M-parameter model
to memorise from a few thousand RL samples, and the answer is checkable but not given. The constant
``b`` is read off the prompt (``f(0)``), so a character model warm-started for ~100 supervised steps
copies it well but often picks the wrong *family* (``x+136`` for ``136,135,134,...``): its greedy
answer solves ~15% while one of 8 samples solves ~50% — a choice that RL sharpens from reward alone
(measured: docs/learning.md). ``a*x+b`` needs ``a = f(1)-f(0)`` and stays the hardest family.

Train/eval split: a function is in the eval split iff a hash of its shown values falls in the
bottom ``EVAL_FRACTION`` (so equal functions of different families share a split); train batches
reject eval functions, so the splits are disjoint by construction and independent of seeds.
``score_locally`` evaluates model output with ``eval`` and exists ONLY for unit tests; the pipeline
scores through :class:`FuncfitEnv` (:func:`to_verify_request`, the sandbox pool).
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from infra.envspec import FUNCFIT_FAMILIES, check_families

if TYPE_CHECKING:  # the sandbox package is imported lazily at call time
    from evals.env import Item, Score
    from infra.sandbox import SandboxPool, VerifyRequest

SHOWN_X: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
HIDDEN_X_START = 6
EVAL_FRACTION = 0.3

# family -> ((a_min, a_max), (b_min, b_max)), inclusive; a family without "a" has the range (0, 0).
# The constants are mostly *read off* the prompt (b = f(0) for all but b-x, where b = f(0) too), so
# the hard part is recognising the family from the shape of the values (step +1, step -1, squares,
# period, step a) — a discrete choice a warm-started model gets partly right, and which RL sharpens.
RANGES: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "x+b": ((0, 0), (0, 299)),
    "b-x": ((0, 0), (6, 305)),
    "x*x+b": ((0, 0), (0, 299)),
    "a*x+b": ((2, 9), (1, 99)),
    "x%a+b": ((2, 5), (0, 99)),  # a >= 6 would look linear on the shown points
}
FAMILIES: tuple[str, ...] = FUNCFIT_FAMILIES  # the names the config validates (infra/envspec.py)
if tuple(RANGES) != FAMILIES:
    raise RuntimeError(f"funcfit RANGES {tuple(RANGES)} and infra.envspec families {FAMILIES} differ")
_FUNCS: dict[str, Callable[[int, int, int], int]] = {
    "x+b": lambda a, b, x: x + b,
    "b-x": lambda a, b, x: b - x,
    "x*x+b": lambda a, b, x: x * x + b,
    "a*x+b": lambda a, b, x: a * x + b,
    "x%a+b": lambda a, b, x: x % a + b,
}

_EXPR_CHARS = re.compile(r"^[0-9x+\-*%() ]+$")


@dataclass(frozen=True)
class Problem:
    """One funcfit task. ``prompt`` is fed to the policy verbatim; ``hidden`` holds (x, f(x))."""

    id: str
    prompt: str
    family: str
    a: int
    b: int
    shown: list[tuple[int, int]] = field(hash=False)
    hidden: list[tuple[int, int]] = field(hash=False)
    solution: str = ""


def _solution(family: str, a: int, b: int) -> str:
    return family.replace("a", str(a)).replace("b", str(b))


def _value(family: str, a: int, b: int, x: int) -> int:
    if family not in _FUNCS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return _FUNCS[family](a, b, x)


def format_prompt(values: list[int]) -> str:
    """The prompt for values at x=0..5, e.g. ``"3,5,7,9,11,13="``. Short on purpose: the demo
    model reads characters, and prompt length is most of the training compute."""
    return ",".join(str(v) for v in values) + "="


def make_problem(family: str, a: int, b: int, hidden_tests: int = 6) -> Problem:
    """Build the problem for one (family, a, b)."""
    shown = [(x, _value(family, a, b, x)) for x in SHOWN_X]
    hidden = [(x, _value(family, a, b, x)) for x in range(HIDDEN_X_START, HIDDEN_X_START + hidden_tests)]
    return Problem(
        id=f"{family}|{a}|{b}",
        prompt=format_prompt([y for _, y in shown]),
        family=family,
        a=a,
        b=b,
        shown=shown,
        hidden=hidden,
        solution=_solution(family, a, b),
    )


def _constants(family: str, rng: random.Random) -> tuple[int, int]:
    (a_lo, a_hi), (b_lo, b_hi) = RANGES[family]
    return rng.randint(a_lo, a_hi), rng.randint(b_lo, b_hi)


def is_eval(family: str, a: int, b: int) -> bool:
    """True iff (family, a, b) belongs to the held-out eval split.

    The hash is over the *shown values* (the prompt), not the constants, so one function written
    two ways — ``(x+2)*3`` and ``3*x+6`` — can never sit in both splits. Seed independent."""
    values = ",".join(str(_value(family, a, b, x)) for x in SHOWN_X)
    h = hashlib.sha256(values.encode()).digest()
    return int.from_bytes(h[:8], "big") < EVAL_FRACTION * 2**64


def all_functions() -> list[tuple[str, int, int]]:
    """Every (family, a, b) in the space, in a fixed order."""
    out: list[tuple[str, int, int]] = []
    for fam, ((a_lo, a_hi), (b_lo, b_hi)) in RANGES.items():
        out += [(fam, a, b) for a in range(a_lo, a_hi + 1) for b in range(b_lo, b_hi + 1)]
    return out


def _draw(rng: random.Random, want_eval: bool, hidden_tests: int, families: tuple[str, ...] = FAMILIES) -> Problem:
    while True:
        fam = rng.choice(families)
        a, b = _constants(fam, rng)
        if is_eval(fam, a, b) == want_eval:
            return make_problem(fam, a, b, hidden_tests)


def train_batch(seed: int, step: int, n: int, hidden_tests: int = 6,
                families: "tuple[str, ...] | list[str] | None" = None) -> list[Problem]:
    """``n`` fresh training problems, deterministic in (seed, step); never from the eval split.
    ``families``: draw only from these (default: all)."""
    fams = check_families(families)
    rng = random.Random(f"funcfit-train|{seed}|{step}")
    return [_draw(rng, False, hidden_tests, fams) for _ in range(n)]


def eval_set(seed: int, n: int, hidden_tests: int = 6,
             families: "tuple[str, ...] | list[str] | None" = None) -> list[Problem]:
    """``n`` held-out problems, deterministic in ``seed``.

    Distinct functions while each family's eval split lasts (~85-230 functions a family, ~600 in all), then it cycles through them
    again in a new order; families are drawn uniformly like the train split.
    """
    chosen = check_families(families)
    pool = [f for f in all_functions() if is_eval(*f)]
    rng = random.Random(f"funcfit-eval|{seed}")
    by_family: dict[str, list[tuple[str, int, int]]] = {fam: [] for fam in FAMILIES}
    for f in pool:
        by_family[f[0]].append(f)
    for fams in by_family.values():
        rng.shuffle(fams)
    out: list[Problem] = []
    cursor = {fam: 0 for fam in FAMILIES}
    while len(out) < n:
        fam = chosen[len(out) % len(chosen)]
        lst = by_family[fam]
        f = lst[cursor[fam] % len(lst)]
        cursor[fam] += 1
        out.append(make_problem(*f, hidden_tests=hidden_tests))
    return out


def sft_examples(seed: int, n: int, hidden_tests: int = 6,
                 families: "tuple[str, ...] | list[str] | None" = None) -> list[tuple[str, str]]:
    """``n`` supervised (prompt, target) pairs from the train split; target ends with a newline."""
    fams = check_families(families)
    rng = random.Random(f"funcfit-sft|{seed}")
    return [(p.prompt, p.solution + "\n") for p in (_draw(rng, False, hidden_tests, fams) for _ in range(n))]


def extract_expression(completion: str) -> str:
    """The expression in a completion: its first line, stripped, with an optional ``f(x)=`` /
    ``return`` prefix removed. Returns "" when nothing is left."""
    line = completion.strip().split("\n", 1)[0].strip() if completion.strip() else ""
    for prefix in ("return ", "f(x)=", "f(x) ="):
        if line.startswith(prefix):
            line = line[len(prefix) :].strip()
    return line


def to_program(expr: str) -> str:
    """A program defining ``f(x)`` that returns ``expr`` (the sandbox calls ``f``)."""
    body = expr if expr else "None"
    return f"def f(x):\n    return {body}\n"


def to_verify_request(problem: "Problem | Sequence[Sequence[int]]", completion: str,
                      timeout_s: float | None = None) -> "VerifyRequest":
    """The sandbox request that checks ``completion`` on the hidden tests: a problem's, or (x, f(x))
    pairs as an item's ``data["hidden"]`` holds them."""
    from infra.sandbox import TestCase, VerifyRequest

    hidden = problem.hidden if isinstance(problem, Problem) else problem
    return VerifyRequest(
        program=to_program(extract_expression(completion)),
        entry="f",
        tests=[TestCase(args=[x], expected=y) for x, y in hidden],
        timeout_s=timeout_s,
    )


def score_locally(problem: Problem, completion: str) -> float:
    """Reward computed in-process. TESTS ONLY: it ``eval``s model output, restricted to arithmetic
    characters; the pipeline scores in sandboxes."""
    expr = extract_expression(completion)
    if not expr or not _EXPR_CHARS.match(expr) or "**" in expr or len(expr) > 64:
        return 0.0
    try:
        code = compile(expr, "<expr>", "eval")
    except (SyntaxError, ValueError):
        return 0.0
    passed = 0
    for x, y in problem.hidden:
        try:
            got: Any = eval(code, {"__builtins__": {}}, {"x": x})  # noqa: S307 - charset-restricted
        except Exception:  # any runtime error of the candidate is a failed test
            continue
        passed += int(got == y)
    return passed / len(problem.hidden)


class FuncfitEnv:
    """funcfit as an :class:`~evals.env.Environment`: items carry their hidden tests, scored in the sandbox pool.

    Prompts are the bare value list (``"3,5,7,9,11,13="``) and sampling stops at a newline; a chat
    model gets the prompt as its user message with :data:`SYSTEM_PROMPT`."""

    name = "funcfit"
    needs_sandbox = True
    SYSTEM_PROMPT = "Answer with one Python expression in x that gives these values of f at x=0..5."

    def __init__(self, seed: int = 1234, hidden_tests: int = 6,
                 families: "tuple[str, ...] | list[str] | None" = None, stop: tuple[str, ...] = ("\n",),
                 system_prompt: str | None = None) -> None:
        self.seed, self.hidden_tests, self.families = seed, hidden_tests, check_families(families)
        self.stop = tuple(stop)
        self.system_prompt = self.SYSTEM_PROMPT if system_prompt is None else system_prompt

    @classmethod
    def from_config(cls, cfg: Any) -> "FuncfitEnv":
        """From an ``env`` config section of type funcfit (:class:`infra.config.FuncfitEnvConfig`)."""
        return cls(cfg.seed, cfg.hidden_tests, cfg.families, tuple(cfg.stop) if cfg.stop is not None else ("\n",),
                   cfg.system_prompt)

    @staticmethod
    def to_item(p: Problem) -> "Item":
        """The environment item of a problem: hidden tests in ``data``, the family as its group."""
        from evals.env import Item

        return Item(id=p.id, prompt=p.prompt, answer=p.solution, group=p.family, data={"hidden": p.hidden})

    def train_items(self, step: int, n: int) -> "list[Item]":
        """``n`` fresh training functions for ``step`` (never held-out ones)."""
        return [self.to_item(p) for p in train_batch(self.seed, step, n, self.hidden_tests, self.families)]

    def heldout_items(self, n: int) -> "list[Item]":
        """The first ``n`` held-out functions."""
        return [self.to_item(p) for p in eval_set(self.seed, n, self.hidden_tests, self.families)]

    def sft_examples(self, seed: int, n: int) -> list[tuple[str, str]]:
        """Warm-start (prompt, solution) pairs from the train split."""
        return sft_examples(seed, n, self.hidden_tests, self.families)

    def score(self, items: "Sequence[Item]", completions: "Sequence[str]",
              pool: "SandboxPool | None") -> "list[Score]":
        """Each completion's expression on the item's hidden points, in the sandbox pool."""
        from evals.env import Score, check_batch, infra_failed, need_pool, unscored

        check_batch(items, completions)
        sandbox = need_pool(self.name, pool)
        reqs = [to_verify_request(it.data["hidden"], c) for it, c in zip(items, completions)]
        results = sandbox.verify_many(reqs, dedupe=sandbox.cfg.dedupe)
        return [unscored() if infra_failed(r) else Score(float(r.reward), r.reward >= 1.0, r.reason) for r in results]
