"""Math-answer equivalence by ``math-verify``, in a helper process bounded in time and memory.

``math-verify`` parses both sides with sympy (no ``eval`` of model output), but sympy on a hostile
answer can run for hours or fill memory (``9^{9^{9^{9}}}``, ``(10^{10})!``). The package bounds its
work with ``SIGALRM``, which only a process's main thread may arm, and an alarm cannot interrupt a
long C-level step at all. Scoring runs in worker threads (Prefect tasks), so the comparisons run in
one long-lived helper process of ours instead (trusted code, untrusted input):

* inside it, on its main thread, every parse and verify is bounded by ``math-verify``'s own alarm
  (:data:`STAGE_TIMEOUT_S`) and the process's address space by ``RLIMIT_AS``
  (:data:`HELPER_MEMORY_BYTES`): a parse that runs out of either is a wrong answer;
* the host waits at most :data:`ITEM_DEADLINE_S` per comparison; past it the helper is killed (the
  answer is wrong) and the next comparison starts a fresh one.

Answers longer than :data:`MATH_MAX_CHARS` are wrong without being parsed. The helper speaks JSON
lines on its stdin/stdout (``[answer, reference]`` in, ``1``/``0`` out), starts on first use (about a
second: importing sympy) and ends with the host (end of its stdin).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

MATH_MAX_CHARS = 256
STAGE_TIMEOUT_S = 2
ITEM_DEADLINE_S = 10.0
START_DEADLINE_S = 120.0
HELPER_MEMORY_BYTES = 2 << 30
_READY = b"ready"


def _as_math(text: str) -> str:
    """Plain expressions go inside ``$...$`` so math-verify reads them as LaTeX math."""
    return text if "$" in text or "\\" in text else f"${text}$"


@lru_cache(maxsize=4096)
def _parse_reference(reference: str, timeout_s: int) -> Any:
    from math_verify import parse

    return parse(_as_math(reference), parsing_timeout=timeout_s)  # type: ignore[arg-type]


def equivalent(answer: str, reference: str, timeout_s: int = STAGE_TIMEOUT_S) -> bool:
    """math-verify's verdict in *this* process (main thread only: it arms ``SIGALRM``).

    Used by the helper process; call :func:`math_match_many` from anywhere else."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    if len(answer) > MATH_MAX_CHARS:
        return False
    try:
        gold = _parse_reference(reference, timeout_s)
        pred = parse(_as_math(answer), parsing_timeout=timeout_s)  # type: ignore[arg-type]
        return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout_s))
    except (Exception, TimeoutException):  # a parse failure on model output is a wrong answer, not a crash
        return False


def serve() -> None:
    """The helper's loop: one ``[answer, reference]`` JSON line in, ``1`` or ``0`` out, until EOF."""
    import logging
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (HELPER_MEMORY_BYTES, HELPER_MEMORY_BYTES))
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the protocol
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its timeout lines are our wrong answers
    import math_verify  # noqa: F401  (imported before "ready", so the first deadline covers no import)

    out.write(_READY + b"\n")
    for line in sys.stdin.buffer:
        try:
            answer, reference = json.loads(line)
            ok = equivalent(str(answer), str(reference))
        except (ValueError, TypeError):
            ok = False
        out.write(b"1\n" if ok else b"0\n")


class MathChecker:
    """A client of one helper process (started on first use, restarted after a kill); thread-safe."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = os.getpid()  # a forked copy of this client must not share the parent's helper
        self._buf = b""
        self._lock = threading.Lock()
        self.kills = 0  # comparisons that ran past the deadline (the helper was killed)

    @property
    def helper_pid(self) -> int | None:
        """The running helper's process id (None before first use or after a kill)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _start(self) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        proc = subprocess.Popen([sys.executable, "-c", "from evals.mathcheck import serve; serve()"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._proc, self._buf = proc, b""
        if self._readline(time.monotonic() + START_DEADLINE_S) != _READY:
            self._kill()
            raise RuntimeError("the math-verify helper process did not start (see its stderr above)")
        return proc

    def _readline(self, deadline: float) -> bytes | None:
        """The helper's next line, or None when it is silent past ``deadline`` or has exited."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()

    def check_many(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """The verdict on each ``(answer, reference)``; an answer past the deadline is wrong."""
        out: list[bool] = []
        with self._lock:
            if self._pid != os.getpid():
                self._proc, self._pid = None, os.getpid()
            for answer, reference in pairs:
                if len(answer) > MATH_MAX_CHARS:
                    out.append(False)
                    continue
                proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
                assert proc.stdin is not None
                try:
                    proc.stdin.write(json.dumps([answer, reference]).encode() + b"\n")
                    proc.stdin.flush()
                except BrokenPipeError:
                    line = None
                else:
                    line = self._readline(time.monotonic() + ITEM_DEADLINE_S)
                if line is None:
                    self.kills += 1
                    self._kill()
                out.append(line == b"1")
        return out

    def close(self) -> None:
        """Stop this process's helper (it also ends by itself when this process exits); a forked
        copy of the client leaves its parent's helper alone."""
        with self._lock:
            if self._pid == os.getpid():
                self._kill()


_CHECKER = MathChecker()
atexit.register(_CHECKER.close)


def math_match_many(pairs: Sequence[tuple[str, str]]) -> list[bool]:
    """Mathematical equivalence of each ``(answer, reference)``, from any thread (see the module docstring)."""
    return _CHECKER.check_many(pairs)
