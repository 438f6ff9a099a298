"""Config tree: every shipped config validates; invalid input fails with every problem listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.config import ConfigError, RunConfig, apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.name


def test_all_problems_listed_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  steps: -1\n  lr: fast\nsandbox:\n  runtime: chroot\nunknown_section: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    text = str(info.value)
    assert len(info.value.problems) == 4
    for needle in ("trainer.steps", "trainer.lr", "sandbox.runtime", "unknown_section"):
        assert needle in text


def test_cross_field_rules() -> None:
    with pytest.raises(ConfigError, match="allow_unsandboxed"):
        load_config(None, ["sandbox.runtime=unsafe_local"])
    cfg = load_config(None, ["sandbox.runtime=unsafe_local", "sandbox.allow_unsandboxed=true"])
    assert cfg.sandbox.runtime == "unsafe_local"
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, ["model.type=gguf"])
    with pytest.raises(ConfigError, match="min_warm"):
        load_config(None, ["sandbox.min_warm=9", "sandbox.max_warm=2"])


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_config(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(binary)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_overrides_parse_yaml_values() -> None:
    data: dict = {}
    problems = apply_overrides(data, ["trainer.lr=1e-4", "trainer.steps=7", "promote.enabled=false", "oops"])
    assert data["trainer"]["steps"] == 7 and data["promote"] == {"enabled": False}
    assert len(problems) == 1 and "oops" in problems[0]
    cfg = load_config(None, ["trainer.lr=1e-4", "name=1e5"])
    assert cfg.trainer.lr == 1e-4 and cfg.name == "1e5"


def test_config_hash_is_stable_and_sensitive() -> None:
    a = load_config(None)
    b = load_config(None)
    c = load_config(None, ["trainer.lr=0.001"])
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_defaults_resolve_under_run_root(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run_root={tmp_path}"])
    assert cfg.resolved_storage_root() == f"file://{tmp_path}/store"
    assert cfg.resolved_tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
