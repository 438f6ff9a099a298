"""infra.proc with real processes: port reporting, death reasons, stopping whole trees, one-line errors."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from infra.cluster.local import LocalProvider
from infra.config import ClusterConfig, RunConfig
from infra.lifeline import PARENT_ENV
from infra.proc import (ServiceDied, ServiceSpec, ServiceStartError, alive, describe_exit, file_probe, http_probe,
                        spawn, start_with_retry, summarize, wait_until)
from infra.specs import SPEC_ENV, RolloutSpec, TrainerSpec
from infra.storage import open_store

# binds port 0 itself, reports the port it got, then answers one connection with b"hi"
SERVER = """
import sys
from infra.proc import bind_socket, report_ready
sock = bind_socket("127.0.0.1", 0)
report_ready(sys.argv[1], port=sock.getsockname()[1])
conn, _ = sock.accept()
conn.sendall(b"hi")
conn.close()
"""

# a child in the group, and a grandchild that left it (new session); both pids reported
TREE = """
import subprocess, sys, time
from infra.proc import report_ready
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
escaped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
report_ready(sys.argv[1], pids=[kid.pid, escaped.pid])
time.sleep(600)
"""


def _spec(tmp_path: Path, name: str, code: str, *args: str) -> ServiceSpec:
    return ServiceSpec(name=name, argv=[sys.executable, "-c", code, *args], log=str(tmp_path / f"{name}.log"),
                       cwd=str(Path(__file__).resolve().parents[2]))


def test_child_binds_port_zero_and_reports_it(tmp_path: Path) -> None:
    ready = str(tmp_path / "ready.json")
    svc = spawn(_spec(tmp_path, "server", SERVER, ready))
    try:
        info = svc.wait_ready(file_probe(ready), 30)
        with socket.create_connection(("127.0.0.1", info["port"]), timeout=10) as conn:
            assert conn.recv(2) == b"hi"
        wait_until(lambda: svc.poll() == 0, 10)
    finally:
        svc.terminate()


def test_death_before_ready_gives_exit_status_and_log_tail(tmp_path: Path) -> None:
    code = "import sys; print('loading model'); print('OSError: [Errno 98] address already in use'); sys.exit(3)"
    svc = spawn(_spec(tmp_path, "worker", code))
    with pytest.raises(ServiceDied) as info:
        svc.wait_ready(file_probe(str(tmp_path / "never.json")), 30)
    text = str(info.value)
    assert "worker stopped: exit code 3" in text and "Errno 98" in text and str(tmp_path / "worker.log") in text
    assert "Errno 98" in summarize(text) and "\n" not in summarize(text)


def test_signal_death_and_deadline(tmp_path: Path) -> None:
    svc = spawn(_spec(tmp_path, "sleeper", "import time; time.sleep(600)"))
    with pytest.raises(ServiceDied, match="not ready within"):
        svc.wait_ready(lambda: None, 0.3)
    os.kill(svc.pid, 9)
    wait_until(lambda: svc.poll() is not None, 10)
    assert "killed by SIGKILL" in (svc.dead_reason() or "")
    assert describe_exit(-15) == "killed by SIGTERM" and describe_exit(2) == "exit code 2"


def test_stop_kills_children_and_escaped_grandchildren(tmp_path: Path) -> None:
    ready = str(tmp_path / "tree.json")
    svc = spawn(_spec(tmp_path, "tree", TREE, ready))
    pids = svc.wait_ready(file_probe(ready), 30)["pids"]
    assert all(alive(p) for p in pids)
    svc.terminate(timeout=5)
    assert svc.poll() is not None
    wait_until(lambda: not any(alive(p) for p in pids), 10)


def test_lifeline_and_env(tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    code = f"import os; open({str(out)!r}, 'w').write(os.environ['{PARENT_ENV}'] + ' ' + os.environ['X'])"
    svc = spawn(ServiceSpec(name="env", argv=[sys.executable, "-c", code], env={"X": "1"}))
    wait_until(lambda: svc.poll() is not None, 30)
    assert out.read_text() == f"{os.getpid()} 1"


def test_start_with_retry_then_one_line(tmp_path: Path) -> None:
    calls: list[int] = []
    cleaned: list[int] = []

    def start() -> None:
        calls.append(1)
        svc = spawn(_spec(tmp_path, "bad", "import sys; print('ValueError: no such model'); sys.exit(1)"))
        svc.wait_ready(lambda: None, 30)

    with pytest.raises(ServiceStartError) as info:
        start_with_retry("rollout worker", start, lambda: cleaned.append(1))
    msg = str(info.value)
    assert len(calls) == 2 and len(cleaned) == 2 and not info.value.retryable
    assert "\n" not in msg and msg.startswith("rollout worker could not start") and "no such model" in msg
    assert "bad.log" in info.value.detail

    attempts = iter([ServiceDied("first try failed"), None])

    def flaky() -> str:
        exc = next(attempts)
        if exc:
            raise exc
        return "up"

    assert start_with_retry("x", flaky, lambda: None) == "up"


def test_http_probe_is_none_until_a_server_answers() -> None:
    assert http_probe("http://127.0.0.1:9/health", timeout=0.5)() is None


def test_local_provider_places_a_service_here(tmp_path: Path) -> None:
    ready = str(tmp_path / "ready.json")
    handle = LocalProvider(ClusterConfig(type="local", ranks=1)).launch_service(_spec(tmp_path, "svc", SERVER, ready))
    try:
        port = wait_until(file_probe(ready), 30, handle.dead_reason)["port"]
        assert handle.host == "127.0.0.1" and handle.logs == [str(tmp_path / "svc.log")]
        with socket.create_connection((handle.host, port), timeout=10) as conn:
            assert conn.recv(2) == b"hi"
    finally:
        handle.terminate()
    assert handle.poll() is not None and "svc pid" in handle.describe()


def test_specs_carry_only_their_sections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RunConfig.model_validate({"trainer": {"lr": 1e-4}, "rollout": {"threads": 3}})
    store = open_store(str(tmp_path / "store"))
    spec = TrainerSpec.build(cfg, "run1", store.uri, "ctl.json", tmp_path, init_dir=None)
    monkeypatch.setenv(SPEC_ENV, spec.to_env()[SPEC_ENV])
    back = TrainerSpec.read()
    assert back == spec and back.config.trainer.lr == 1e-4 and back.config.config_hash() == cfg.config_hash()
    assert open_store(**back.store.model_dump()).uri == store.uri
    assert set(back.config.model_dump()) == {"seed", "model", "warmstart", "cluster", "trainer", "rollout",
                                              "weight_sync", "run_config_hash"}
    roll = RolloutSpec.build(cfg, "run1", store.uri, "addr.json")
    assert set(RolloutSpec.read(roll.write(tmp_path / "r.json")).config.model_dump()) == {
        "seed", "model", "rollout", "weight_sync"}
    assert roll.config.rollout.threads == 3 and roll.port == 0
    assert TrainerSpec.read(spec.write(tmp_path / "t.json")) == spec


def test_cli_logs_a_project_error_without_traceback() -> None:
    """A service that could not start reaches the terminal as one line: Prefect's failure logs of a
    DeltaloopError lose their traceback (other exceptions keep it)."""
    import logging

    from deltaloop.cli import _no_traceback_for_project_errors

    _no_traceback_for_project_errors()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        for exc in (ServiceStartError("rollout worker", "stopped: exit code 1\nOSError: [Errno 98] in use"),
                    KeyError("bug")):
            try:
                raise exc
            except Exception:
                logger.error("Task run failed with exception: %r", exc, exc_info=True)
    finally:
        logger.removeHandler(handler)
    assert records[0].exc_info is None and "Errno 98" in records[0].getMessage()
    assert records[1].exc_info is not None
