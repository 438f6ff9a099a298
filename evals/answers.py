"""Finding the answer in a completion, and the pure comparisons that score it on the trusted side.

An instruct model answers in prose ("The sum is 42."), in a box (``\\boxed{42}``), in tags
(``<answer>42</answer>``) or in a fenced code block. :func:`extract_answer` applies one configured
rule (``env.answer.extract``) and returns ``None`` when the completion has no answer of that shape —
which :func:`shaped_reward` can reward separately (``env.answer.format_weight``), so a model first
learns to answer in the expected shape, then to answer right.

The comparisons (:func:`exact_match`, :func:`numeric_match`, :func:`math_match`, :func:`regex_match`)
never execute model output: they compare text, parse numbers, or hand both sides to the
``math-verify`` package (which parses with sympy, no ``eval``; in a helper process bounded in time
and memory, :mod:`evals.mathcheck`).
"""

from __future__ import annotations

import math
import re
from typing import Callable

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_CODE_BLOCK = re.compile(r"```[^\n`]*\n(.*?)(?:```|$)", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start >= 0:
        i = text.find("{", start)
        if i < 0:
            return None
        depth, j = 0, i
        while j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j].strip()
            j += 1
        start = text.rfind("\\boxed", 0, start)
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (thousands separators removed), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>``, or None."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def code_block(text: str) -> str | None:
    """The first fenced code block's body (an unclosed fence runs to the end), or None."""
    m = _CODE_BLOCK.search(text)
    return m.group(1) if m else None


def whole_text(text: str) -> str | None:
    """The completion stripped; None when it is empty."""
    return text.strip() or None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "boxed": last_boxed,
    "answer_tag": answer_tag,
    "last_number": last_number,
    "code_block": code_block,
    "text": whole_text,
}


SYSTEM_PROMPTS: dict[str, str] = {
    "boxed": "Solve the problem. Put only the final answer inside \\boxed{}.",
    "answer_tag": "Solve the problem. Give only the final answer inside <answer></answer> tags.",
    "last_number": "Solve the problem. End your reply with the final answer as a number.",
    "code_block": "Answer with the complete Python code in one ```python code block.",
    "text": "Reply with only the final answer.",
}


def default_system_prompt(rule: str) -> str:
    """The system message that asks for an answer the extraction ``rule`` finds."""
    if rule not in SYSTEM_PROMPTS:
        raise ValueError(f"unknown answer extraction {rule!r}; known: {', '.join(SYSTEM_PROMPTS)}")
    return SYSTEM_PROMPTS[rule]


def extract_answer(text: str, rule: str) -> str | None:
    """The answer in ``text`` by ``rule`` (one of :data:`EXTRACTORS`), or None when absent."""
    try:
        fn = EXTRACTORS[rule]
    except KeyError:
        raise ValueError(f"unknown answer extraction {rule!r}; known: {', '.join(EXTRACTORS)}") from None
    return fn(text)


def shaped_reward(correct: bool, well_formed: bool, format_weight: float) -> float:
    """``(1 - w) * correct + w * well_formed``: the reward with an optional share for the answer's shape."""
    return (1.0 - format_weight) * float(correct) + format_weight * float(well_formed)


def _norm(s: str) -> str:
    return " ".join(s.strip().split()).casefold()


def exact_match(answer: str, reference: str) -> bool:
    """Equal after trimming, collapsing whitespace and case-folding."""
    return _norm(answer) == _norm(reference)


def parse_number(s: str) -> float | None:
    """A float from ``s`` (an optional ``$``/``%`` and thousands separators allowed), else None."""
    t = s.strip().replace(",", "").removeprefix("$").removesuffix("%").strip()
    try:
        v = float(t)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def numeric_match(answer: str, reference: str, tolerance: float = 1e-6) -> bool:
    """Both parse as numbers that agree within ``tolerance`` (absolute, or relative to the reference)."""
    a, r = parse_number(answer), parse_number(reference)
    if a is None or r is None:
        return False
    return abs(a - r) <= tolerance * max(1.0, abs(r))


def math_match(answer: str, reference: str) -> bool:
    """Mathematical equivalence by the ``math-verify`` package (LaTeX or plain expressions).

    Safe from any thread and on hostile input: the comparison runs in a helper process bounded in
    time and memory (:mod:`evals.mathcheck`); batches go through :func:`evals.mathcheck.math_match_many`."""
    from evals.mathcheck import math_match_many

    return math_match_many([(answer, reference)])[0]


def regex_match(answer: str, pattern: str) -> bool:
    """``answer`` (stripped) fully matches the reference ``pattern``; an invalid pattern matches nothing."""
    try:
        return re.fullmatch(pattern, answer.strip(), flags=re.DOTALL) is not None
    except re.error:
        return False
