"""Plain data types of the sandbox API (requests and results).

These are the values that cross the seam between the pipeline's scoring stage and the sandbox pool
(see ``docs/INTERFACES.md``). They are frozen-free dataclasses of JSON-able values so that a
scoring task can store them in the object store as JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infra.errors import DeltaloopError

#: Why a job ended. ``wrong`` and ``syntax`` only appear in :class:`VerifyResult` and :class:`TestsResult`;
#: ``infra`` (always with ``infra=True``) means the job could not be run at all, see :data:`INFRA_DOC`.
REASONS: tuple[str, ...] = ("ok", "timeout", "memory", "output_limit", "killed", "error", "wrong", "syntax", "infra")

#: What ``infra=True`` on a result means (the same for every result type).
INFRA_DOC = (
    "infra=True (reason 'infra', reward 0.0): the sandbox or its runtime failed for reasons outside the job "
    "(runner killed from outside, container removed, daemon error, no sandbox could be started) on every one "
    "of the sandbox.infra_retries + 1 attempts, each on a fresh sandbox. The reward means nothing: leave the "
    "sample out of the loss. A job that timed out, ran out of memory or output, crashed, or killed or "
    "exhausted its own sandbox has infra=False and its own reason."
)


@dataclass
class TestCase:
    """One hidden test: ``entry(*args) == expected`` (floats compared with a tiny tolerance)."""

    __test__ = False  # not a pytest class

    args: list[Any]
    expected: Any


@dataclass
class VerifyRequest:
    """Score ``program``: define it, then call ``entry`` on every test's args inside the sandbox."""

    program: str
    entry: str
    tests: list[TestCase]
    timeout_s: float | None = None


@dataclass
class VerifyResult:
    """Outcome of one :class:`VerifyRequest`; ``reward`` is the fraction of tests passed.

    ``infra``: the job could not be scored because the infrastructure failed (:data:`INFRA_DOC`)."""

    passed: list[bool]
    reward: float
    reason: str
    stdout_tail: str = ""
    stderr_tail: str = ""
    wall_seconds: float = 0.0
    infra: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)


@dataclass
class TestsRequest:
    """Score ``program`` against trusted assert-style ``tests`` (HumanEval's ``check(candidate)``,
    MBPP's ``assert f(1) == 2`` lines, or top-level ``test_*`` functions).

    ``context`` is trusted code run before the tests in their namespace (HumanEval's prompt: the
    helpers its tests use). ``entry`` names the program's function under test, bound also as
    ``candidate``; it is needed when the tests define ``check``. The program runs in a process of its
    own; the tests call its functions through stubs whose arguments and return values cross as
    ``repr`` text decoded with ``ast.literal_eval``, so only literal values (numbers, strings,
    bytes, None, and tuples/lists/dicts/sets of them) pass between the two.
    """

    __test__ = False  # not a pytest class

    program: str
    tests: str
    context: str = ""
    entry: str | None = None
    timeout_s: float | None = None


@dataclass
class TestsResult:
    """Outcome of one :class:`TestsRequest`: ``passed`` (all tests) and ``reward`` 1.0, or 0.0.

    ``reason``: ``ok``, ``wrong`` (a test failed or raised), ``syntax``, ``timeout``, ``memory``,
    ``output_limit``, ``killed`` or ``error`` (the program did not load, has no ``entry``, or the
    tests are unusable), or ``infra`` with ``infra=True`` (:data:`INFRA_DOC`). The failing assertion
    is at the end of ``stderr_tail``.
    """

    __test__ = False  # not a pytest class

    passed: bool
    reward: float
    reason: str
    stdout_tail: str = ""
    stderr_tail: str = ""
    wall_seconds: float = 0.0
    infra: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return asdict(self)


@dataclass
class ExecResult:
    """Outcome of running one program as ``__main__``.

    ``exit_code`` is the program's exit status, ``-N`` if it died of signal N, or ``None`` when the
    sandbox stopped it (timeout, output limit) or could not run it. ``infra``: it could not be run
    because the infrastructure failed (:data:`INFRA_DOC`).
    """

    exit_code: int | None
    reason: str
    stdout_tail: str = ""
    stderr_tail: str = ""
    wall_seconds: float = 0.0
    infra: bool = False
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (without ``extra``)."""
        d = asdict(self)
        d.pop("extra", None)
        return d


class SandboxError(DeltaloopError):
    """The sandbox infrastructure failed (not a job): no sandbox could be started.

    Retryable: a daemon restarting or a transient load may be gone on the next attempt.
    """

    retryable = True


class SandboxUnusable(SandboxError):
    """The sandbox cannot work in this setting (runtime or interpreter missing, an unsafe runtime not
    allowed, the pool already closed): the same attempt would fail the same way."""

    retryable = False


class SandboxDied(DeltaloopError):
    """A sandbox's runner stopped answering or exited (internal: the pool turns it into a result).

    ``kind`` is what the host saw: ``"timeout"`` (no reply within the job's timeout plus the host's
    grace), ``"gone"`` (end of stream, a failed write, a broken connection, a closed handle) or
    ``"garbled"`` (a line that is not a reply). The job cannot write to the runner's stdout, so
    ``gone`` and ``garbled`` are never its doing unless the runtime says the sandbox ran out of
    memory; ``timeout`` is counted as the job's.
    """

    KINDS = ("timeout", "gone", "garbled")

    def __init__(self, message: str, kind: str = "gone") -> None:
        super().__init__(message)
        self.kind = kind
