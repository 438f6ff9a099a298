"""Survive failures without losing (or changing) a step: a SIGKILLed trainer rank mid-step, and a
SIGKILLed flow resumed with ``deltaloop run --resume``. On CPU with fixed seeds the final trainer
state (fp32 weights and AdamW moments) and the final published weights must be bit-identical to an
uninterrupted run of the same config.

Every run is the real CLI in a subprocess (Prefect's own server, torchrun ranks, rollout worker,
bubblewrap sandboxes, file object store). The rank kill is a real SIGKILL that the rank sends itself
in the middle of step 4 (after its first backward), armed by the test-only ``faults/sitecustomize.py``
(``DELTALOOP_TRAINER_FAULT``, see there); the flow kill is a SIGKILL of the CLI's whole process group
once step 3 has trained.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FAULTS = Path(__file__).resolve().parent / "faults"  # sitecustomize.py that arms DELTALOOP_TRAINER_FAULT
# big enough that rewards differ within groups (non-zero advantages, real updates), small enough to be quick
RESUME_TINY = [
    "trainer.steps=4", "trainer.prompts_per_step=8", "trainer.group_size=4", "trainer.checkpoint_every=2",
    "warmstart.steps=150", "env.eval_problems=10", "model.tiny.hidden_size=64", "model.tiny.num_layers=2",
    "model.tiny.intermediate_size=128", "model.tiny.num_heads=2", "sandbox.runtime=bwrap", "promote.enabled=false",
]


def _cmd(root: Path, *extra: str) -> list[str]:
    sets = [a for o in [*RESUME_TINY, f"run_root={root}"] for a in ("--set", o)]
    return [str(Path(sys.executable).parent / "deltaloop"), "run", "configs/demo.yaml", *sets, *extra]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DELTALOOP_TRAINER_FAULT"}
    env.setdefault("DELTALOOP_STATE", str(REPO / ".state"))
    return {**env, **extra}


def _with_fault(spec: str) -> dict[str, str]:
    """Environment additions that make every process load the fault plugin, armed with ``spec``."""
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    return {"DELTALOOP_TRAINER_FAULT": spec, "PYTHONPATH": path}


def _run(root: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(root, *extra), cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _run_id(root: Path) -> str:
    runs = [p.name for p in (root / "store" / "runs").iterdir()]
    assert len(runs) == 1, runs
    return runs[0]


def final_state(root: Path) -> dict:
    """The final checkpoint's fp32 model and optimizer state, and the newest published weights."""
    import io

    import torch

    from infra.storage import open_store
    from infra.train.checkpoint import committed_steps, read_manifest
    from infra.weightsync import VersionReader

    run_id = _run_id(root)
    store = open_store(f"file://{root}/store")
    last = committed_steps(store, run_id)[-1]
    man = read_manifest(store, run_id, last)
    replica = next(k for k in man["keys"] if k.endswith("/replica.pt"))
    state = torch.load(io.BytesIO(store.get(replica)), weights_only=True)
    published, version = VersionReader(store, f"runs/{run_id}/weights").fetch()
    return {"step": last, "version": version, "model": state["model"], "optimizer": state["optimizer"]["state"],
            "published": published, "weights_version": man["weights_version"]}


def assert_identical(a: dict, b: dict) -> None:
    import torch

    assert (a["step"], a["version"], a["weights_version"]) == (b["step"], b["version"], b["weights_version"])
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weights differ: {k}"
    for i in a["optimizer"]:
        for k in a["optimizer"][i]:
            assert torch.equal(a["optimizer"][i][k], b["optimizer"][i][k]), f"optimizer state differs: {i}.{k}"
    for k in a["published"]:
        assert torch.equal(a["published"][k], b["published"][k]), f"published weights differ: {k}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted run of the config."""
    root = tmp_path_factory.mktemp("reference") / "runs"
    _run(root)
    state = final_state(root)
    assert state["step"] == 4 and state["version"] == 5
    return state


def _warm_started(root: Path) -> dict:
    """fp32 weights of the checkpoint of step 0 (after the warm start, before any RL step)."""
    import io

    import torch

    from infra.storage import open_store
    from infra.train.checkpoint import read_manifest

    store = open_store(f"file://{root}/store")
    man = read_manifest(store, _run_id(root), 0)
    replica = next(k for k in man["keys"] if k.endswith("/replica.pt"))
    return torch.load(io.BytesIO(store.get(replica)), weights_only=True)["model"]


def test_killed_rank_mid_step_restarts_and_is_bit_identical(reference: dict, tmp_path: Path) -> None:
    import torch

    root = tmp_path / "runs"
    proc = _run(root, **_with_fault("step=4,rank=1"))
    assert "trainer group died" in proc.stderr and "replaying steps 3..3" in proc.stderr, proc.stderr[-3000:]
    assert (root / "store" / "runs" / _run_id(root) / "faults").is_dir()  # the SIGKILL really happened
    got = final_state(root)
    assert_identical(got, reference)
    # and training really moved the weights (the comparison is not between two untouched models)
    start = _warm_started(root)
    assert any(not torch.equal(start[k], got["model"][k]) for k in start)


def _wait_file(pattern: str, root: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(root.glob(pattern)):
            return
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    raise AssertionError(f"{pattern} did not appear")


def _wait_no_services(root: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    # the run root is in a service's command line or its spec (DELTALOOP_SPEC)
                    if str(root).encode() in (d / "cmdline").read_bytes() + (d / "environ").read_bytes():
                        alive.append(d.name)
                except OSError:
                    pass
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"services of the killed flow still running: {alive}")


def test_killed_flow_resumes_bit_identical(reference: dict, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    proc = subprocess.Popen(_cmd(root), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_file("store/runs/*/step-000003/train.json", root, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI, its Prefect server: the whole flow process group
        proc.wait()
    _wait_no_services(root)  # trainer ranks and rollout worker follow their parent
    run_id = _run_id(root)
    assert not (root / run_id / "summary.json").exists()
    out = _run(root, "--resume", run_id)
    assert "resumed trainer from the checkpoint of step 2" in out.stderr, out.stderr[-3000:]
    assert _run_id(root) == run_id
    assert (root / run_id / "summary.json").exists()
    assert_identical(final_state(root), reference)
