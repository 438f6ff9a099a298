"""Answer extraction rules and the trusted-side comparisons (exact, numeric, math, regex)."""

from __future__ import annotations

import threading
import time

import pytest

from evals.answers import (
    EXTRACTORS,
    default_system_prompt,
    exact_match,
    extract_answer,
    math_match,
    numeric_match,
    parse_number,
    regex_match,
    shaped_reward,
)
from evals.mathcheck import MATH_MAX_CHARS, MathChecker, math_match_many


@pytest.mark.parametrize("rule,text,expected", [
    ("boxed", "so \\boxed{1} then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("boxed", "\\boxed{ {a}{b} }", "{a}{b}"),
    ("boxed", "no box here", None),
    ("boxed", "\\boxed{unclosed", None),
    ("answer_tag", "<answer>3</answer> wait <ANSWER> 4 </ANSWER>", "4"),
    ("answer_tag", "<answer>3", None),
    ("last_number", "from 1,234 to 5,678.5 kg", "5678.5"),
    ("last_number", "it is -3 or .5", ".5"),
    ("last_number", "none", None),
    ("code_block", "Here:\n```python\ndef f():\n    return 1\n```\nand ```\nx\n```", "def f():\n    return 1\n"),
    ("code_block", "```\nprint(1)\n", "print(1)"),
    ("code_block", "def f(): return 1", None),
    ("text", "  42 \n", "42"),
    ("text", " \n ", None),
])
def test_extraction_rules(rule: str, text: str, expected: str | None) -> None:
    assert extract_answer(text, rule) == expected


def test_every_rule_has_a_system_prompt_and_unknown_rules_fail() -> None:
    for rule in EXTRACTORS:
        assert default_system_prompt(rule)
    assert "\\boxed{}" in default_system_prompt("boxed")
    with pytest.raises(ValueError, match="unknown answer extraction 'xml'; known: boxed"):
        extract_answer("x", "xml")
    with pytest.raises(ValueError, match="unknown answer extraction"):
        default_system_prompt("xml")


def test_shaped_reward() -> None:
    assert shaped_reward(True, True, 0.0) == 1.0
    assert shaped_reward(False, True, 0.0) == 0.0
    assert shaped_reward(False, True, 0.2) == pytest.approx(0.2)
    assert shaped_reward(True, True, 0.2) == pytest.approx(1.0)
    assert shaped_reward(False, False, 0.2) == 0.0


def test_exact_numeric_regex() -> None:
    assert exact_match("  Paris \n", "paris") and exact_match("New  York", "new york")
    assert not exact_match("Paris.", "Paris")
    assert parse_number("$1,234.50") == 1234.5 and parse_number("15%") == 15.0
    assert parse_number("inf") is None and parse_number("x") is None
    assert numeric_match("1,000", "1000") and numeric_match("0.3333", "0.33333", tolerance=1e-3)
    assert not numeric_match("0.3", "0.33333", tolerance=1e-3) and not numeric_match("three", "3")
    assert numeric_match("1000001", "1000000", tolerance=1e-6)  # relative to the reference
    assert regex_match(" 3.14 ", r"3\.14\d*") and not regex_match("3.14 or 2", r"3\.14\d*")
    assert not regex_match("anything", "(unclosed")


MATH_CASES = [
    ("\\frac{1}{2}", "0.5", True),
    ("0.5", "\\frac{1}{2}", True),
    ("2x+x^2", "x^2+2x", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("$\\sqrt{4}$", "2", True),
    ("3", "4", False),
    ("2x", "x^2+2x", False),
    ("not math at all", "1", False),
]


def test_math_match_equivalences() -> None:
    for answer, reference, expected in MATH_CASES:
        assert math_match(answer, reference) is expected, (answer, reference)
    assert math_match_many([(a, r) for a, r, _ in MATH_CASES]) == [e for _, _, e in MATH_CASES]


def test_math_match_off_the_main_thread_is_the_same_and_bounded() -> None:
    """Scoring runs in worker threads (Prefect tasks): same verdicts, and hostile input stays bounded."""
    hostile = ["9^{9^{9^{9}}}", "(10^{10})!", "1" * (MATH_MAX_CHARS + 1)]
    pairs = [(a, r) for a, r, _ in MATH_CASES] + [(h, "1") for h in hostile]
    got: dict[str, list[bool]] = {}
    thread = threading.Thread(target=lambda: got.setdefault("r", math_match_many(pairs)))
    t0 = time.monotonic()
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert got["r"] == [e for _, _, e in MATH_CASES] + [False] * len(hostile)
    assert time.monotonic() - t0 < 60


def test_math_helper_past_the_deadline_is_killed_and_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A comparison the host stops waiting for is wrong; the next one runs in a fresh helper process."""
    import evals.mathcheck as mathcheck

    checker = MathChecker()
    try:
        assert checker.check_many([("1/2", "0.5")]) == [True]  # helper started (import not timed below)
        monkeypatch.setattr(mathcheck, "ITEM_DEADLINE_S", 0.5)  # shorter than the helper's own 2 s alarm
        assert checker.check_many([("(10^{10})!", "1"), ("2x+x^2", "x^2+2x")]) == [False, True]
        assert checker.kills == 1
    finally:
        checker.close()


def test_a_forked_process_gets_its_own_math_helper() -> None:
    """A fork (a process pool, a forking server) must not talk to its parent's helper process."""
    import os

    checker = MathChecker()
    try:
        assert checker.check_many([("1/2", "0.5")]) == [True]
        helper = checker.helper_pid
        pid = os.fork()
        if pid == 0:  # the child: closing first must spare the parent's helper; then its own, right answers
            code = 1
            try:
                checker.close()
                code = 0 if checker.check_many([("2x+x^2", "x^2+2x"), ("3", "4")]) == [True, False] else 1
                checker.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert helper is not None and checker.helper_pid == helper  # the parent's helper is untouched
        assert checker.check_many([("\\frac{1}{4}", "0.25")]) == [True]
        assert checker.kills == 0
    finally:
        checker.close()
