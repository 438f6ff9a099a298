"""``deltaloop sandbox exec`` end to end, explicit docker hosts, and warm-buffer sizing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deltaloop import cli_sandbox
from infra.config import SandboxConfig
from infra.sandbox import SandboxError, TestCase, VerifyRequest, create_pool
from tests.cli_helpers import cli_app

RUNTIMES = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]


def _need(runtime: str) -> None:
    if runtime == "bwrap" and shutil.which("bwrap") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("bubblewrap missing on CI")
        pytest.skip("bubblewrap is not installed")
    if runtime == "docker":
        try:
            import docker

            docker.from_env().ping()
        except Exception as exc:
            if os.environ.get("CI") == "true":
                pytest.fail(f"docker daemon unreachable on CI: {exc}")
            pytest.skip(f"docker daemon unreachable: {exc}")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_cli_exec_prints_one_json_and_exits_zero(runtime: str, tmp_path: Path) -> None:
    _need(runtime)
    runner = CliRunner()
    prog = tmp_path / "p.py"
    prog.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nraise SystemExit(7)\n")
    res = runner.invoke(cli_app(cli_sandbox.register), ["sandbox", "exec", "--runtime", runtime, str(prog), "--timeout", "5"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout.strip().splitlines()[-1])
    assert {"exit_code", "reason", "stdout_tail", "stderr_tail", "wall_seconds"} <= set(obj)
    assert (obj["exit_code"], obj["reason"], obj["stdout_tail"]) == (7, "error", "out\n")
    assert "err" in obj["stderr_tail"]
    prog.write_text("while True:\n    pass\n")
    res = runner.invoke(cli_app(cli_sandbox.register), ["sandbox", "exec", "--runtime", runtime, str(prog), "--timeout", "0.3"])
    assert res.exit_code == 0 and json.loads(res.stdout.strip().splitlines()[-1])["reason"] == "timeout"


@pytest.mark.docker
def test_explicit_docker_hosts_list() -> None:
    _need("docker")
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    cfg = SandboxConfig(runtime="docker", docker_hosts=[host], concurrency=2, min_warm=1, max_warm=2)
    with create_pool(cfg) as pool:
        res = pool.verify_many([VerifyRequest("def f(x):\n    return x\n", "f", [TestCase([3], 3)])] * 4)
    assert [r.reward for r in res] == [1.0] * 4
    with pytest.raises(SandboxError, match="no usable Docker host"):
        create_pool(SandboxConfig(runtime="docker", docker_hosts=["unix:///nonexistent.sock"]))


def test_warm_buffer_follows_the_sizing_rule() -> None:
    _need("bwrap")
    cfg = SandboxConfig(runtime="bwrap", concurrency=3, min_warm=1, max_warm=3, idle_timeout_s=0)
    with create_pool(cfg) as pool:
        assert pool.metrics()["warm_size"] == 1  # min_warm at start
        reqs = [VerifyRequest("def f(x):\n    return x\n", "f", [TestCase([1], 1)])] * 30
        assert all(r.reward == 1.0 for r in pool.verify_many(reqs))
        m = pool.metrics()
        assert m["jobs"] == 30 and m["errors"] == 0
        assert m["sandboxes_started"] <= 3  # never more than max_warm without retirements
        assert pool.target() == 1  # nothing in flight: back to min_warm


def test_bwrap_with_separate_rootfs_hides_the_host() -> None:
    _need("bwrap")
    rootfs = "/var/cache/deltaloop/rootfs"
    if not os.path.isdir(os.path.join(rootfs, "scratch")):
        pytest.skip("no debootstrap rootfs (scripts/setup_sandbox.sh builds it with the docker image)")
    cfg = SandboxConfig(runtime="bwrap", rootfs=rootfs, min_warm=1, max_warm=1, concurrency=1)
    with create_pool(cfg) as pool:
        res = pool.exec(f"import os\nprint(os.path.exists({str(Path.cwd())!r}), os.path.exists('/root/.pyenv'))\n")
    assert (res.reason, res.stdout_tail) == ("ok", "False False\n"), res


def test_dedupe_runs_each_distinct_request_once() -> None:
    """An RL batch repeats itself: with dedupe, copies share one sandbox job but get their own result."""
    _need("bwrap")
    cfg = SandboxConfig(runtime="bwrap", concurrency=2, min_warm=1, max_warm=2)
    right = VerifyRequest("def f(x):\n    return x + 1\n", "f", [TestCase([1], 2), TestCase([2], 3)])
    wrong = VerifyRequest("def f(x):\n    return x * 2\n", "f", [TestCase([1], 2), TestCase([2], 3)])
    same_program_other_tests = VerifyRequest(right.program, "f", [TestCase([5], 7)])
    reqs = [right, wrong, right, same_program_other_tests, wrong, right]
    with create_pool(cfg) as pool:
        pool.metrics(reset=True)
        res = pool.verify_many(reqs, dedupe=True)
        assert pool.metrics()["jobs"] == 3  # right, wrong, right-on-other-tests
        plain = pool.verify_many(reqs)
        assert pool.metrics()["jobs"] == 3 + len(reqs)
        assert pool.verify_many([], dedupe=True) == []
    assert [r.reward for r in res] == [1.0, 0.5, 1.0, 0.0, 0.5, 1.0] == [r.reward for r in plain]
    res[0].passed[0] = False  # each copy is its own object
    assert res[2].passed == [True, True]
