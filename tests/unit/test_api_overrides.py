"""The allow-list of what a deployment-triggered run may ask for (issue #15, finding 6).

Replays, on the pure check every flow calls first (``infra.config.check_api_request``), the
requests an attacker with access to the Prefect API sends: overrides that become a command on the
worker (``cluster.hosts[0].proxy_command``, ``cluster.hosts=[...]``, ``cluster.ssh_options``), that
move files or credentials (``run_root``, ``storage.root``, ``tracking.uri``), that load code or
data from a path (``env.entry``, ``env.path``, ``model.path``, ``eval.suites``), that weaken the
promotion gate (``promote.margin``); config files outside ``configs/``; a traversing ``resume``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.config import (DEFAULT_API_OVERRIDES, PROJECT_CONFIGS, OverrideRefused, api_override_allowlist,
                          check_api_request, load_config)

DEMO = str(PROJECT_CONFIGS / "demo.yaml")

HOSTILE = [
    "cluster.hosts[0].proxy_command=touch /tmp/pwned",
    "cluster.hosts=[{host: h, proxy_command: 'touch /tmp/pwned'}]",
    "cluster.type=hosts",
    "cluster.ssh_options=[-oProxyCommand=touch /tmp/pwned]",
    "cluster.remote_python=/tmp/evil",
    "cluster.kubernetes.image=evil:latest",
    "run_root=/etc",
    "storage.root=s3://attacker/bucket",
    "storage.endpoint_url=http://attacker:9000",
    "tracking.uri=http://attacker:5000",
    "init_from=models:/other/1",
    "model.path=/tmp/evil-model",
    "model.type=hf",
    "env.type=python",
    "env.entry=os:system",
    "env.path=/etc/shadow",
    "env.prompt_template={item.__class__}",
    "eval.suites=[{name: x, env: {type: python, entry: 'os:system'}}]",
    "sandbox.runtime=unsafe_local",
    "sandbox.docker_hosts=[tcp://attacker:2375]",
    "promote.margin=-1",
    "promote.enabled=true",
    " .cluster..hosts = []",
    "trainer=[1]",
]


@pytest.mark.parametrize("item", HOSTILE)
def test_hostile_override_is_refused_with_the_key_and_the_list(item: str) -> None:
    """Finding 6: an API-triggered override that could run a command, move data or weaken the gate."""
    with pytest.raises(OverrideRefused) as info:
        check_api_request(DEMO, ["trainer.steps=2", item], environ={})
    msg = str(info.value)
    assert "\n" not in msg and "not allowed" in msg and "trainer.*" in msg and "DELTALOOP_API_OVERRIDES" in msg
    key = ".".join(p for p in item.split("=", 1)[0].strip().split(".") if p)
    assert repr(key) in msg


def test_tuning_overrides_pass_and_still_load() -> None:
    """What the served tests and a normal caller send stays possible, and the config still validates."""
    ok = ["trainer.steps=2", "trainer.lora.rank=4", "warmstart.steps=30", "env.eval_problems=20",
          "model.tiny.hidden_size=64", "rollout.temperature=0.7", "loop.mode=async", "eval.every=5",
          "name=api-run", "seed=3"]
    check_api_request(DEMO, ok, environ={})
    cfg = load_config(DEMO, ok)
    assert cfg.trainer.steps == 2 and cfg.model.tiny.hidden_size == 64 and cfg.loop.mode == "async"


def test_operator_replaces_or_extends_the_list_from_the_environment(tmp_path: Path) -> None:
    """The list comes from the worker's environment: a variable, a file, 'default' for the defaults."""
    assert api_override_allowlist({}) == DEFAULT_API_OVERRIDES
    extended = api_override_allowlist({"DELTALOOP_API_OVERRIDES": "default, run_root"})
    assert extended[:len(DEFAULT_API_OVERRIDES)] == DEFAULT_API_OVERRIDES and extended[-1] == "run_root"
    check_api_request(DEMO, ["run_root=/srv/runs"], environ={"DELTALOOP_API_OVERRIDES": "default run_root"})
    only = {"DELTALOOP_API_OVERRIDES": "trainer.steps"}
    check_api_request(DEMO, ["trainer.steps=5"], environ=only)
    with pytest.raises(OverrideRefused, match="'trainer.lr'"):
        check_api_request(DEMO, ["trainer.lr=0.1"], environ=only)
    with pytest.raises(OverrideRefused, match="allowed: none"):
        check_api_request(DEMO, ["seed=1"], environ={"DELTALOOP_API_OVERRIDES": ""})
    listed = tmp_path / "allow.txt"
    listed.write_text("# tuning only\ntrainer.*   # the trainer\nsandbox.timeout_s\n")
    env = {"DELTALOOP_API_OVERRIDES_FILE": str(listed)}
    assert api_override_allowlist(env) == ("trainer.*", "sandbox.timeout_s")
    check_api_request(DEMO, ["sandbox.timeout_s=3"], environ=env)
    with pytest.raises(OverrideRefused, match="cannot read the override allow-list"):
        check_api_request(DEMO, [], environ={"DELTALOOP_API_OVERRIDES_FILE": str(tmp_path / "missing")})


def test_config_must_be_a_project_config(tmp_path: Path) -> None:
    """Finding 6: an API-triggered run naming any YAML file on the worker (or a path out of configs/)."""
    outside = tmp_path / "evil.yaml"
    outside.write_text("cluster: {type: hosts, hosts: [{host: h, proxy_command: 'touch /tmp/pwned'}]}\n")
    rel = os.path.relpath(outside, Path.cwd())
    for config in (str(outside), rel, str(PROJECT_CONFIGS / ".." / "prefect.yaml"),
                   str(PROJECT_CONFIGS / ".." / "configs" / ".." / "pyproject.toml"), "/etc/passwd"):
        with pytest.raises(OverrideRefused, match="is not allowed for a run triggered through a deployment"):
            check_api_request(config, [], environ={})
    link = tmp_path / "configs-link"
    link.symlink_to(PROJECT_CONFIGS)
    check_api_request(str(link / "demo.yaml"), [], environ={})  # resolves into configs/
    check_api_request(str(outside), [], environ={"DELTALOOP_API_CONFIGS": str(tmp_path)})


def test_resume_must_be_a_run_id() -> None:
    """Finding 6: ``resume`` is joined onto run_root; an API caller must not point it elsewhere."""
    check_api_request(DEMO, [], "demo-20261202-101010-abcd", environ={})
    for bad in ("../../etc", "/tmp/x", "a/../../b", ".."):
        with pytest.raises(OverrideRefused, match="is not a run id"):
            check_api_request(DEMO, [], bad, environ={})
