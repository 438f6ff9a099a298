"""One chaos run: a real ``deltaloop run`` on the S3 store, faults injected when the run reaches them.

The run's progress is read from the S3 server's journal (:class:`bench.chaos_s3.JournalTail`):
every acknowledged ``PUT`` of a step's ``prompts.json`` (rollout starts), ``rollouts.json``
(scoring starts), ``scores.json`` (training starts) and of a weight manifest (a version is
published). A fault waits for its trigger event at (or, when that one has passed, after) its
planned step, then for its seeded delay, then is injected (:mod:`bench.chaos_inject`); the step it
is recorded at is the step whose event triggered it.

A killed flow is resumed with ``deltaloop run --resume RUN`` — the sandbox runtime alternates at
each planned flow kill (bwrap, then docker, then bwrap), so one run exercises both runtimes. A flow
that fails on its own is resumed too, at most ``max_unplanned`` times, and every such failure is
recorded with the last error line of its log: the harness measures what the code does, it does not
hide it.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import chaos_inject as inj
from bench.chaos_s3 import DurableS3, JournalTail
from infra.storage import ObjectStore, open_store

STEP_EVENT = re.compile(r"runs/([^/]+)/step-(\d{6})/(prompts|rollouts|scores)\.json$")
MANIFEST_EVENT = re.compile(r"runs/([^/]+)/weights/v(\d{8})/manifest\.json\.zst$")
TRIGGER_ORDER = {"prompts": 0, "rollouts": 1, "scores": 2, "manifest": 3}
SERVICES = ("infra.rollout.server", "infra.train.worker", "torch.distributed.run", "bwrap")


@dataclass(frozen=True)
class Fault:
    """One planned fault: what, at which step, on which event, after how long, with which seed."""

    kind: str
    step: int
    trigger: str
    delay_s: float
    seed: int


@dataclass(frozen=True)
class Event:
    """An acknowledged write the run made: ``kind`` is a trigger name, ``step`` its step (manifest: the
    version), ``t`` when the bench saw it."""

    kind: str
    step: int
    t: float


def parse_event(method: str, path: str, t: float) -> Event | None:
    """The trigger event a journaled request stands for, if any."""
    if method != "PUT":
        return None
    if found := STEP_EVENT.search(path):
        return Event(found.group(3), int(found.group(2)), t)
    if found := MANIFEST_EVENT.search(path):
        return Event("manifest", int(found.group(2)), t)
    return None


def find_trigger(events: list[Event], start: int, fault: Fault) -> int | None:
    """Index (from ``start``) of the event that fires ``fault``: the first of its trigger kind at or
    after its step; for ``manifest``, the first manifest after the first such ``scores`` event."""
    want = "scores" if fault.trigger == "manifest" else fault.trigger
    for i in range(start, len(events)):
        ev = events[i]
        if ev.kind == want and ev.step >= fault.step:
            if fault.trigger != "manifest":
                return i
            return next((j for j in range(i + 1, len(events)) if events[j].kind == "manifest"), None)
    return None


@dataclass
class FlowLog:
    """What happened to the flow processes of one chaos run."""

    faults: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    resumes: int = 0
    unplanned_resumes: int = 0
    orphans: list[str] = field(default_factory=list)
    finished: bool = False
    timed_out: bool = False


class ChaosRun:
    """Drives one chaos run end to end (see the module docstring)."""

    def __init__(self, folder: Path, sets: list[str], mode: str, s3: DurableS3, deadline_s: float,
                 max_unplanned: int = 3) -> None:
        self.folder = folder
        self.run_root = folder / "runs"
        self.sets = sets + [f"run_root={self.run_root}", f"loop.mode={mode}", "storage.type=s3",
                            f"storage.root=s3://chaos/{mode}", f"storage.endpoint_url={s3.endpoint}"]
        self.s3 = s3
        self.tail = JournalTail(s3.journal)
        self.tail.poll()  # skip what earlier runs on this server wrote
        self.store: ObjectStore = open_store(f"s3://chaos/{mode}", endpoint_url=s3.endpoint)
        self.deadline = time.monotonic() + deadline_s
        self.max_unplanned = max_unplanned
        self.log = FlowLog()
        self.events: list[Event] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.flow_pids: list[int] = []
        self.seen: dict[tuple[int, int], inj.Proc] = {}
        self.run_id: str | None = None
        self.runtime = "bwrap"
        self.t0 = time.monotonic()
        self.over = False  # the run finished or was given up: nothing more is started
        self._last_tree = 0.0

    # ------------------------------------------------------------------ flow processes
    def start_flow(self, resume: str | None) -> None:
        """Start ``deltaloop run`` (or ``--resume``) with the current sandbox runtime."""
        cmd = [str(Path(sys.executable).parent / "deltaloop"), "run", "configs/demo.yaml"]
        if resume:
            cmd += ["--resume", resume]
        for s in self.sets + [f"sandbox.runtime={self.runtime}"]:
            cmd += ["--set", s]
        log = open(self.folder / f"flow-{len(self.flow_pids) + 1}.log", "ab")
        self.proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.flow_pids.append(self.proc.pid)

    def _watch_tree(self) -> None:
        if self.proc is None or time.monotonic() - self._last_tree < 0.5:
            return
        self._last_tree = time.monotonic()
        for p in inj.tree(self.proc.pid):
            self.seen.setdefault((p.pid, p.start), p)

    def _find_run_id(self) -> None:
        if self.run_id is None and self.run_root.is_dir():
            runs = [d.name for d in self.run_root.iterdir() if (d / "config.yaml").is_file()]
            self.run_id = runs[0] if len(runs) == 1 else None

    def pump(self) -> bool:
        """Read new journal events, note processes; False once the flow process has exited."""
        try:
            for method, path in self.tail.poll():
                ev = parse_event(method, path, time.monotonic() - self.t0)
                if ev is not None:
                    self.events.append(ev)
        except (OSError, ValueError):
            pass
        self._watch_tree()
        self._find_run_id()
        return self.proc is not None and self.proc.poll() is None

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` while pumping; False if the flow exited meanwhile."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self.pump():
                return False
            time.sleep(0.02)
        return self.pump()

    def _cleanup_after(self, pid: int, grace_s: float) -> list[str]:
        """After flow ``pid`` ended: services of it still alive after ``grace_s`` (orphans) are listed,
        then everything it started is killed and its containers removed."""
        time.sleep(grace_s)
        left = [p for p in self.seen.values() if inj.still_alive(p)]
        orphans = [next((s for s in SERVICES if s in p.cmdline), p.cmdline[:40]) for p in left
                   if any(s in p.cmdline for s in SERVICES)]
        inj.kill_leftovers(left)
        inj.remove_containers([pid])
        self.seen.clear()
        return orphans

    def _last_error(self) -> str:
        path = self.folder / f"flow-{len(self.flow_pids)}.log"
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()] if path.exists() else []
        errors = [ln for ln in lines if ln.startswith("error:")] or [ln for ln in lines if "Error" in ln]
        return (errors or lines or ["(empty log)"])[-1][:400]

    def handle_exit(self) -> bool:
        """The flow exited on its own: True if the run goes on (resumed), False when it is over."""
        assert self.proc is not None
        if self.over:
            return False
        self.over = True  # until a resume below
        code = self.proc.wait()
        step = max((e.step for e in self.events if e.kind == "scores"), default=0)
        orphans = self._cleanup_after(self.proc.pid, 1.0)
        if code == 0:
            self.log.finished = True
            return False
        self.log.failures.append({"step": step, "exit": code, "error": self._last_error(), "orphans": orphans})
        if self.log.unplanned_resumes >= self.max_unplanned or self.run_id is None or self.expired():
            return False
        self.log.unplanned_resumes += 1
        self.over = False
        self.start_flow(self.run_id)
        return True

    def expired(self) -> bool:
        """True once the run's wall-clock budget is spent."""
        return time.monotonic() > self.deadline

    # ------------------------------------------------------------------ faults
    def inject(self, fault: Fault, step: int) -> str:
        """Inject ``fault`` now (its trigger fired at ``step``); returns the action line."""
        assert self.proc is not None
        rng = random.Random(fault.seed)
        pid = self.proc.pid
        if fault.kind == "sandbox_bwrap":
            return inj.kill_bwrap_sandbox(pid, rng)
        if fault.kind == "sandbox_docker":
            return inj.kill_docker_sandbox(pid, rng)
        if fault.kind == "rollout_worker":
            return inj.kill_rollout_worker(pid)
        if fault.kind == "trainer_rank":
            return inj.kill_trainer_rank(pid, rng)
        if fault.kind == "s3_restart":
            down = self.s3.restart(down_s=rng.uniform(1.0, 3.0))
            return f"kill -9 of the S3 server, back on the same port after {down:.1f}s"
        if fault.kind == "corrupt_weight":
            return self._corrupt(step, rng)
        if fault.kind == "flow":
            return self._kill_flow(pid)
        raise ValueError(f"unknown fault kind {fault.kind!r}")

    def _corrupt(self, version: int, rng: random.Random) -> str:
        assert self.run_id is not None
        objs = inj.weight_objects(self.store, self.run_id, version)
        frames = [k for k in objs if not k.endswith("manifest.json.zst")]
        manifest = [k for k in objs if k.endswith("manifest.json.zst")]
        target = rng.choice(frames) if frames and rng.random() < 0.5 else (manifest or frames)[0]
        return inj.corrupt_object(self.store, target, rng)

    def _kill_flow(self, pid: int) -> str:
        assert self.proc is not None
        action = inj.kill_flow(pid)
        self.proc.wait()
        orphans = self._cleanup_after(pid, 5.0)
        self.log.orphans += orphans
        self.runtime = "docker" if self.runtime == "bwrap" else "bwrap"
        self.log.resumes += 1
        self.start_flow(self.run_id)
        return f"{action}; {len(orphans)} service processes outlived it by 5s {orphans}; resumed with " \
               f"--resume {self.run_id} (sandbox.runtime={self.runtime})"

    def run(self, plan: list[Fault]) -> FlowLog:
        """Start the run, inject every fault of ``plan`` in order, wait for the end; the log."""
        self.start_flow(None)
        cursor = 0
        for fault in plan:
            self.log.faults.append(self._one(fault, cursor))
            cursor = self.log.faults[-1].pop("cursor", cursor)
        self._wait_end()
        return self.log

    def _one(self, fault: Fault, cursor: int) -> dict[str, Any]:
        """Wait for ``fault``'s trigger and delay, inject it; its JSON record (plus the new cursor).

        If the flow exits during the delay and is resumed, the trigger is awaited again in the new
        flow (the step's work is redone there)."""
        while True:
            found = self._wait_trigger(fault, cursor)
            if found is None:
                return {"kind": fault.kind, "step": None, "action": "not injected: the run ended before its trigger",
                        "t": round(time.monotonic() - self.t0, 2)}
            ev = self.events[found]
            if self.sleep(fault.delay_s):
                break
            if not self.handle_exit():
                return {"kind": fault.kind, "step": ev.step, "action": "not injected: the run ended",
                        "t": round(time.monotonic() - self.t0, 2)}
            cursor = len(self.events)
        t = round(time.monotonic() - self.t0, 2)
        action = self.inject(fault, ev.step)
        step = ev.step if fault.trigger != "manifest" else self._step_of_manifest(found)
        return {"kind": fault.kind, "step": step, "action": action, "t": t, "trigger": fault.trigger,
                "delay_s": round(fault.delay_s, 3), "cursor": found}

    def _step_of_manifest(self, index: int) -> int:
        """Step of the scores event that preceded manifest event ``index``."""
        return next((e.step for e in reversed(self.events[:index]) if e.kind == "scores"), 0)

    def _wait_trigger(self, fault: Fault, cursor: int) -> int | None:
        """Index of the event that fires ``fault`` (resuming a flow that fails meanwhile); None when the
        run ended or its time is up."""
        while not self.expired():
            found = find_trigger(self.events, cursor, fault)
            if found is not None:
                return found
            if not self.pump() and not self.handle_exit():
                return None
            time.sleep(0.02)
        self.log.timed_out = True
        return None

    def _wait_end(self) -> None:
        while self.proc is not None:
            if self.expired():
                self.log.timed_out = True
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
                self._cleanup_after(self.proc.pid, 5.0)
                return
            if not self.pump() and not self.handle_exit():
                return
            time.sleep(0.2)
