"""Test helpers for crash tests of the whole RL flow: run the real CLI on a tiny config, stop it at an
exact point (``tests/integration/flowfaults/sitecustomize.py``), kill it with its whole process tree,
and compare what two runs trained.

Every run is ``deltaloop run configs/demo.yaml`` in a subprocess: Prefect's own server, torchrun
ranks, the rollout worker, bubblewrap sandboxes, a file object store under the test's folder. The
undisturbed reference run of a mode is made once per test session and shared by the test modules.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PAUSES = REPO / "tests" / "integration" / "flowfaults"  # sitecustomize.py with the pause points
# big enough that rewards differ within groups (non-zero advantages, real updates), small enough to be quick
TINY = [
    "trainer.steps=4", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.checkpoint_every=2",
    "warmstart.steps=150", "env.eval_problems=10", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=128", "model.tiny.num_heads=2", "sandbox.runtime=bwrap", "promote.enabled=false",
]
RUN_TIMEOUT_S = 900.0

_REFERENCES: dict[str, Path] = {}


def cli(root: Path, mode: str, *extra: str) -> list[str]:
    """The ``deltaloop run`` command line of the tiny config in ``loop.mode`` ``mode`` under ``root``."""
    sets = [a for o in [*TINY, f"loop.mode={mode}", f"run_root={root}"] for a in ("--set", o)]
    return [str(Path(sys.executable).parent / "deltaloop"), "run", "configs/demo.yaml", *sets, *extra]


def run_env(**extra: str) -> dict[str, str]:
    """This process's environment without fault variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DELTALOOP_PAUSE_", "DELTALOOP_TRAINER_FAULT"))}
    env.setdefault("DELTALOOP_STATE", str(REPO / ".state"))
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    return {**env, **extra}


def pause_env(points: list[str], pause_dir: Path) -> dict[str, str]:
    """Environment additions that make the run's processes stop at ``points`` (``POINT@N``)."""
    pause_dir.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(PAUSES), os.environ.get("PYTHONPATH", "")) if p)
    return {"DELTALOOP_PAUSE_AT": ",".join(points), "DELTALOOP_PAUSE_DIR": str(pause_dir), "PYTHONPATH": path}


def run_flow(root: Path, mode: str, *extra: str, **env: str) -> subprocess.CompletedProcess:
    """Run the flow to the end; it must succeed."""
    proc = subprocess.run(cli(root, mode, *extra), cwd=REPO, env=run_env(**env), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def start_paused(root: Path, mode: str, points: list[str], pause_dir: Path) -> tuple[subprocess.Popen, dict]:
    """Start the flow and wait until every one of ``points`` is reached (its process blocks there).

    Returns the CLI process and ``{point: pid of the paused process}``."""
    log = open(root.parent / f"paused-{'-'.join(points)}.log", "w")
    proc = subprocess.Popen(cli(root, mode), cwd=REPO, env=run_env(**pause_env(points, pause_dir)),
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    log.close()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        files = {p: pause_dir / f"{p}.json" for p in points}
        if all(f.exists() and f.stat().st_size for f in files.values()):
            time.sleep(0.2)  # the paused processes are blocked; let anything else in flight settle
            return proc, {p: json.loads(f.read_text())["pid"] for p, f in files.items()}
        if proc.poll() is not None:
            kill_tree(proc, root)
            pytest.fail(f"the run ended before reaching {points}: {Path(log.name).read_text()[-3000:]}")
        time.sleep(0.05)
    kill_tree(proc, root)
    raise AssertionError(f"the run did not reach {points} in {RUN_TIMEOUT_S:.0f}s")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _mentions(root: Path) -> set[int]:
    """Processes whose command line or environment names ``root`` (the run's services)."""
    found: set[int] = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if str(root).encode() in (d / "cmdline").read_bytes() + (d / "environ").read_bytes():
                    found.add(int(d.name))
            except OSError:
                pass
    return found


def _tree(pid: int, root: Path) -> set[int]:
    kids = _children()
    out, todo = set(), [pid, *_mentions(root)]
    while todo:
        p = todo.pop()
        if p not in out and p != os.getpid():
            out.add(p)
            todo.extend(kids.get(p, []))
    return out


def kill_tree(proc: subprocess.Popen, root: Path) -> None:
    """SIGKILL the CLI process and every process it started (services are in their own sessions, so
    this is the whole tree by parent pid, plus anything naming the run folder): a crash of the flow
    and everything it ran. Each process is stopped first so none can start another or act on the
    death of its peers; then all are killed."""
    seen: set[int] = set()
    for _ in range(20):  # until no new process appears under the stopped ones
        new = _tree(proc.pid, root) - seen
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        seen |= new
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)
    wait_no_services(root)


def wait_no_services(root: Path, timeout: float = 30) -> None:
    """Wait until no process names the run folder any more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in _mentions(root) if _state(p) not in (None, "Z")]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of the killed run still alive: {alive}")


def _state(pid: int) -> str | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def run_id(root: Path) -> str:
    """The id of the one run under ``root``."""
    runs = [p.name for p in (root / "store" / "runs").iterdir()]
    assert len(runs) == 1, runs
    return runs[0]


def step_doc(root: Path, step: int, name: str) -> dict | None:
    """``runs/<run>/step-<step>/<name>`` of the run under ``root`` (None if absent)."""
    path = root / "store" / "runs" / run_id(root) / f"step-{step:06d}" / name
    return json.loads(path.read_text()) if path.exists() else None


def trained(root: Path, steps: int = 4) -> list[dict[str, Any]]:
    """Per step, what the trainer recorded it trained: prompt ids, the batch's weight version and the
    digest of its samples and scores (``train.json``)."""
    out = []
    for s in range(1, steps + 1):
        rec = step_doc(root, s, "train.json")
        assert rec is not None, f"step {s} has no training record"
        out.append({k: rec.get(k) for k in ("step", "prompt_ids", "rollout_version", "batch_sha256")})
    return out


def final_weights(root: Path) -> dict[str, Any]:
    """The newest published weights and the last checkpoint's fp32 model and optimizer state."""
    import io

    import torch

    from infra.storage import open_store
    from infra.train.checkpoint import committed_steps, read_manifest
    from infra.weightsync import VersionReader

    rid = run_id(root)
    store = open_store(f"file://{root}/store")
    last = committed_steps(store, rid)[-1]
    man = read_manifest(store, rid, last)
    replica = next(k for k in man["keys"] if k.endswith("/replica.pt"))
    state = torch.load(io.BytesIO(store.get(replica)), weights_only=True)
    published, version = VersionReader(store, f"runs/{rid}/weights").fetch()
    return {"step": last, "version": version, "model": state["model"], "optimizer": state["optimizer"]["state"],
            "published": published, "weights_version": man["weights_version"]}


def assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit-identical final model, optimizer moments and published weights."""
    import torch

    assert (a["step"], a["version"], a["weights_version"]) == (b["step"], b["version"], b["weights_version"])
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weights differ: {k}"
    for i in a["optimizer"]:
        for k in a["optimizer"][i]:
            assert torch.equal(a["optimizer"][i][k], b["optimizer"][i][k]), f"optimizer state differs: {i}.{k}"
    assert a["published"].keys() == b["published"].keys()
    for k in a["published"]:
        assert torch.equal(a["published"][k], b["published"][k]), f"published weights differ: {k}"


def reference(factory: pytest.TempPathFactory, mode: str) -> Path:
    """The run root of the undisturbed run in ``mode`` (made once per session)."""
    if mode not in _REFERENCES:
        root = factory.mktemp(f"reference-{mode}") / "runs"
        run_flow(root, mode)
        _REFERENCES[mode] = root
    return _REFERENCES[mode]
