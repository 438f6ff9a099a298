"""Runs queue for capacity on the served stack (``deltaloop serve``: Prefect server + process worker).

Three ``rl-train`` runs are created through the REST API at once on a cluster with capacity for
one (``trainer-slots`` is created by the first run with one slot). They run one after another and
none is lost: the first is cancelled while it holds the capacity (its teardown gives the slots
back), the second is SIGKILLed (no teardown: its lease expires and the server's repossessor frees
the slots), the third completes. The waiting ones are visibly waiting: their flow runs carry the
``waiting-for-capacity`` tag and a task run named ``waiting for capacity: ...``, and headless
Chromium finds that name on the waiting run's page and the limits on the UI's Concurrency page.

The stack is started as in ``test_ops_served.py`` (its ``Served`` handle and browser helpers), with
``--worker-limit 3`` (the worker takes all three runs, so they queue on the capacity limits, where
they are visible, rather than unseen in the worker) and the repossessor polling every 2 s, not 15 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import pytest

from flows.capacity import TRAINER_SLOTS, WAITING_TAG
from infra.ops.trigger import trigger, wait
from tests.integration.test_ops_served import AUTH, SHOTS, Served, _browser, _wait_text, start_served

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    s = start_served(tmp_path_factory.mktemp("queue"), {"PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "2"},
                     "--worker-limit", "3")
    proc = s.proc
    try:
        yield s
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _logs(served: Served, run_id: str, needle: str) -> list[datetime]:
    """Times of this run's log lines that contain ``needle``."""
    logs = served.post("logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200})
    return [datetime.fromisoformat(x["timestamp"]) for x in logs if needle in x["message"]]


def _explain(served: Served, ids: list[str]) -> str:
    """Each run's state, tags and log lines, for failure messages."""
    out = []
    for i in ids:
        run = served.get(f"flow_runs/{i}")
        logs = served.post("logs/filter", {"logs": {"flow_run_id": {"any_": [i]}}, "limit": 200})
        out.append(f"{run['name']} {run['state']['type']} {run['state'].get('message')} {run['tags']}\n  "
                   + "\n  ".join(x["message"][:300] for x in logs[-25:]))
    return "\n".join(out)


def _holder(served: Served, ids: list[str], done: set[str], timeout: float = 300) -> str:
    """The one run (not in ``done``) that logged 'capacity acquired', once the others wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        holding = [i for i in ids if i not in done and _logs(served, i, "capacity acquired")]
        assert len(holding) <= 1, f"two runs hold the capacity for one: {holding}"
        if holding:
            return holding[0]
        time.sleep(1)
    raise AssertionError("no run acquired the capacity:\n" + _explain(served, ids))


def _flow_run_pid(run_id: str) -> int:
    """The flow-run process the worker started for ``run_id``: of the processes whose environment
    names the run (it and the services it started), the one whose parent is not among them (pids
    wrap, so the lowest pid need not be the flow run's)."""
    found: dict[int, int] = {}  # pid -> parent pid
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if f"PREFECT__FLOW_RUN_ID={run_id}".encode() in env.split(b"\0"):
            found[int(d.name)] = ppid
    tops = [pid for pid, ppid in found.items() if ppid not in found]
    if len(tops) != 1:
        raise AssertionError(f"flow run {run_id}: expected one top process among {found}, found {tops}")
    return tops[0]


def _ui_shows_waiting(served: Served, waiting_id: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    drv = _browser()
    try:
        drv.get(served.ui)
        drv.execute_script("localStorage.setItem('prefect-password', btoa(arguments[0]))", AUTH)
        drv.get(f"{served.ui}/runs/flow-run/{waiting_id}")
        _wait_text(drv, ["waiting for capacity: trainer-slots 1/1 in use", WAITING_TAG], timeout=90)
        drv.save_screenshot(str(SHOTS / "prefect-run-waiting-for-capacity.png"))
        drv.get(f"{served.ui}/concurrency-limits")
        _wait_text(drv, [TRAINER_SLOTS, "rollout-slots"], timeout=60)
        drv.save_screenshot(str(SHOTS / "prefect-concurrency-limits.png"))
    finally:
        drv.quit()


def _gcl(served: Served, name: str) -> dict[str, Any]:
    return served.get(f"v2/concurrency_limits/{name}")


def test_three_runs_on_capacity_for_one_run_one_after_another(served: Served) -> None:
    ids = [trigger(served.api, "rl-train/rl-train", {"config": "configs/demo.yaml", "overrides": served.overrides()},
                   name=f"queued-{i}", auth=AUTH)["id"] for i in range(3)]
    first = _holder(served, ids, set())
    waiting = [i for i in ids if i != first]
    deadline = time.monotonic() + 120
    while not all(WAITING_TAG in served.get(f"flow_runs/{i}")["tags"] for i in waiting):
        assert time.monotonic() < deadline, "the queued runs never showed as waiting:\n" + _explain(served, ids)
        time.sleep(1)
    assert _gcl(served, TRAINER_SLOTS)["active_slots"] == 1 and _gcl(served, TRAINER_SLOTS)["limit"] == 1
    _ui_shows_waiting(served, waiting[0])

    # cancel the holder: its teardown gives the capacity back; the next run takes it
    cancelled_at = time.time()
    served.post(f"flow_runs/{first}/set_state", {"state": {"type": "CANCELLING"}, "force": True})
    first_done = wait(served.api, first, timeout=180, auth=AUTH)
    second = _holder(served, ids, {first})
    handover = min(_logs(served, second, "capacity acquired")).timestamp() - cancelled_at
    print(f"cancel of the holder -> next run holds the capacity: {handover:.1f}s")
    assert min(_logs(served, second, "capacity acquired")) >= max(_logs(served, first, "capacity acquired"))
    assert _logs(served, first, "capacity released"), "the cancelled run did not give its capacity back"

    # SIGKILL the next holder: no teardown; its lease expires and the last run starts
    killed_at = time.time()
    os.kill(_flow_run_pid(second), signal.SIGKILL)
    third = _holder(served, ids, {first, second}, timeout=240)
    waited = min(_logs(served, third, "capacity acquired")).timestamp() - killed_at
    print(f"slots of the SIGKILLed run came back after {waited:.1f}s (lease 60 s, repossessor loop 2 s)")
    assert waited > 0
    second_done = wait(served.api, second, timeout=120, auth=AUTH)
    third_done = wait(served.api, third, timeout=900, auth=AUTH)
    states = [r["state"]["type"] for r in (first_done, second_done, third_done)]
    assert states == ["CANCELLED", "CRASHED", "COMPLETED"], states
    assert all(WAITING_TAG not in served.get(f"flow_runs/{i}")["tags"] for i in (second, third))
    assert _gcl(served, TRAINER_SLOTS)["active_slots"] == 0 and _gcl(served, "rollout-slots")["active_slots"] == 0
