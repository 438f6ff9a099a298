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
import time
from pathlib import Path

import pytest

from tests.flow_helpers import (REPO, assert_same_weights, cli, final_weights, reference, run_env, run_flow,
                                run_id, wait_no_services)

pytestmark = pytest.mark.slow

FAULTS = Path(__file__).resolve().parent / "faults"  # sitecustomize.py that arms DELTALOOP_TRAINER_FAULT


def _with_fault(spec: str) -> dict[str, str]:
    """Environment additions that make every process load the fault plugin, armed with ``spec``."""
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    return {"DELTALOOP_TRAINER_FAULT": spec, "PYTHONPATH": path}


def _run(root: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    return run_flow(root, "sync", *extra, **env)


@pytest.fixture(scope="module")
def ref_state(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An uninterrupted run of the config (shared with the other crash tests of the session)."""
    state = final_weights(reference(tmp_path_factory, "sync"))
    assert state["step"] == 4 and state["version"] == 5
    return state


def _warm_started(root: Path) -> dict:
    """fp32 weights of the checkpoint of step 0 (after the warm start, before any RL step)."""
    import io

    import torch

    from infra.storage import open_store
    from infra.train.checkpoint import read_manifest

    store = open_store(f"file://{root}/store")
    man = read_manifest(store, run_id(root), 0)
    replica = next(k for k in man["keys"] if k.endswith("/replica.pt"))
    return torch.load(io.BytesIO(store.get(replica)), weights_only=True)["model"]


def test_killed_rank_mid_step_restarts_and_is_bit_identical(ref_state: dict, tmp_path: Path) -> None:
    import torch

    root = tmp_path / "runs"
    proc = _run(root, **_with_fault("step=4,rank=1"))
    assert "trainer group died" in proc.stderr and "replaying steps 3..3" in proc.stderr, proc.stderr[-3000:]
    assert (root / "store" / "runs" / run_id(root) / "faults").is_dir()  # the SIGKILL really happened
    got = final_weights(root)
    assert_same_weights(got, ref_state)
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


def test_killed_flow_resumes_bit_identical(ref_state: dict, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    proc = subprocess.Popen(cli(root, "sync"), cwd=REPO, env=run_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_file("store/runs/*/step-000003/train.json", root, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI, its Prefect server: the whole flow process group
        proc.wait()
    wait_no_services(root)  # trainer ranks and rollout worker follow their parent
    rid = run_id(root)
    assert not (root / rid / "summary.json").exists()
    out = _run(root, "--resume", rid)
    assert "resumed trainer from the checkpoint of step 2" in out.stderr, out.stderr[-3000:]
    assert run_id(root) == rid
    assert (root / rid / "summary.json").exists()
    assert_same_weights(final_weights(root), ref_state)
