"""Service processes die with the flow that started them.

Every long-lived service (trainer ranks, rollout worker) gets ``DELTALOOP_PARENT_PID`` (set by
:class:`infra.proc.ServiceSpec`, or by the launcher in a provider's env) and calls
:func:`exit_with_parent`: a daemon thread polls that pid and exits the process as soon as it is gone,
so a flow killed with SIGKILL (no chance to run its teardown) leaves no orphans behind.
"""

from __future__ import annotations

import os
import threading
import time

PARENT_ENV = "DELTALOOP_PARENT_PID"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_with_parent(pid: int | None = None, poll_s: float = 1.0, code: int = 3) -> None:
    """Start the watcher for ``pid`` (default: ``$DELTALOOP_PARENT_PID``; no-op when unset)."""
    if pid is None:
        raw = os.environ.get(PARENT_ENV)
        if not raw:
            return
        pid = int(raw)

    def loop() -> None:
        while pid_alive(pid):
            time.sleep(poll_s)
        os._exit(code)

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()
