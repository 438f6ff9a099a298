"""The one configuration tree of deltaloop.

Every run is described by a :class:`RunConfig` loaded from YAML (``configs/*.yaml``) plus
``--set key=value`` overrides. Every field is documented and bounded; each pluggable backend is
selected by a ``type`` field; cross-field rules live in validators. A config that does not
validate fails *before anything starts*, with one message listing every problem
(see :func:`load_config` and :class:`ConfigError`).

The sections live in :mod:`infra.configs` (one module per area) and are re-exported here, so
``from infra.config import TrainerConfig`` works for every section. Neither this module nor the
sections import torch, vllm, docker or prefect, so that ``deltaloop --help``, config validation and
flow discovery stay fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from infra.configs.base import Strict
from infra.configs.cluster import ClusterConfig, HealthConfig, HostSpec, KubernetesConfig, select_hosts
from infra.configs.cost import CostConfig
from infra.configs.envs import (ENV_TYPES, AnswerConfig, DatasetEnvConfig, EnvConfig, FuncfitEnvConfig,
                                HumanEvalEnvConfig, PythonEnvConfig, ReasoningGymEnvConfig, ReasoningGymTask,
                                default_env_type)
from infra.configs.model import ModelConfig, TinyModelConfig, WarmstartConfig
from infra.configs.placement import check_placement
from infra.configs.services import (
    EvalConfig,
    LoopConfig,
    PromoteConfig,
    RolloutConfig,
    SandboxConfig,
    StorageConfig,
    TrackingConfig,
    WeightSyncConfig,
)
from infra.configs.train import LoraConfig, TrainerConfig
from infra.errors import DeltaloopError

__all__ = [
    "ENV_TYPES", "AnswerConfig", "ClusterConfig", "CostConfig", "ConfigError", "DatasetEnvConfig", "EnvConfig", "FuncfitEnvConfig",
    "HumanEvalEnvConfig", "PythonEnvConfig", "ReasoningGymEnvConfig", "ReasoningGymTask", "EvalConfig", "HealthConfig", "HostSpec", "KubernetesConfig",
    "LoopConfig", "LoraConfig", "ModelConfig", "PromoteConfig", "RolloutConfig", "RunConfig", "SandboxConfig",
    "StorageConfig", "TinyModelConfig", "TrackingConfig", "TrainerConfig", "WarmstartConfig", "WeightSyncConfig",
    "apply_overrides", "dump_config", "load_config", "select_hosts", "validate_config",
    "DEFAULT_API_OVERRIDES", "OverrideRefused", "api_override_allowlist", "check_api_request", "key_allowed",
    "override_key",
]


class ConfigError(DeltaloopError, ValueError):
    """A configuration is invalid. ``problems`` lists one line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config {source}: {len(problems)} problem(s)\n{lines}")


# ---------------------------------------------------------------------------------------- root
class RunConfig(Strict):
    """A whole deltaloop run."""

    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="Run name.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Global seed (trainer, sampler, data).")
    run_root: str = Field("runs", description="Folder for run folders, local store and MLflow db.")
    init_from: str | None = Field(
        None,
        description="Start from a registered model: 'champion' (the alias) or 'models:/name/VERSION'.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    env: EnvConfig = Field(default_factory=FuncfitEnvConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    promote: PromoteConfig = Field(default_factory=PromoteConfig)
    cost: CostConfig = Field(default_factory=CostConfig)

    @field_validator("env", mode="before")
    @classmethod
    def _env_type(cls, v: Any) -> Any:
        return default_env_type(v)

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        if self.cluster.backend == "nccl" and self.trainer.engine == "torch" and self.cluster.type == "local":
            pass  # allowed on GPU hosts; checked at provision time
        if self.trainer.engine == "deepspeed" and self.trainer.zero_stage == 0:
            raise ValueError("trainer.zero_stage must be 1, 2 or 3 when trainer.engine is 'deepspeed'")
        unknown = sorted(set(self.promote.floors) - {"main", *(s.name for s in self.eval.suites)})
        if unknown:
            raise ValueError(f"promote.floors names unknown suite(s) {unknown}: use 'main' (the held-out split) "
                             "or a name in eval.suites")
        check_placement(self)
        return self

    # ----------------------------------------------------------------------------- derived
    def config_hash(self) -> str:
        """Stable short hash of the resolved config (lineage tag)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def resolved_storage_root(self) -> str:
        """Object-store root URI: the configured one or ``file://<run_root>/store``."""
        if self.storage.root:
            root = self.storage.root
            if self.storage.type == "file" and not root.startswith("file://"):
                root = "file://" + str(Path(root).resolve())
            return root
        return "file://" + str((Path(self.run_root) / "store").resolve())

    def resolved_tracking_uri(self) -> str:
        """MLflow tracking URI: the configured one or sqlite under ``run_root``."""
        if self.tracking.uri:
            return self.tracking.uri
        if os.environ.get("MLFLOW_TRACKING_URI"):  # e.g. set by `deltaloop serve` for its worker
            return os.environ["MLFLOW_TRACKING_URI"]
        return "sqlite:///" + str((Path(self.run_root) / "mlflow.db").resolve())


# ------------------------------------------------------------------------------------ loading
def _format_error(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
    msg = err.get("msg", "invalid")
    value = err.get("input")
    shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{path} = {shown}: {msg}"


def _coerce_override(raw: str) -> Any:
    """Parse an override value as YAML (so 3, 1e-4, true, [a, b] work), else keep the string."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    return value  # YAML 1.1 reads "1e-4" as a string; pydantic turns it into a float where one is wanted


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply ``key.sub=value`` overrides in place; returns problems (bad syntax) instead of raising."""
    problems: list[str] = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"--set {item!r}: expected key=value (e.g. trainer.steps=10)")
            continue
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            problems.append(f"--set {item!r}: empty key")
            continue
        node = data
        ok = True
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                problems.append(f"--set {item!r}: {p} is not a section")
                ok = False
                break
            node = nxt
        if ok:
            node[parts[-1]] = _coerce_override(raw)
    return problems


# ------------------------------------------------------------------ runs requested through the API
# A run triggered through a Prefect deployment (the REST API, the UI, a schedule, an automation) is
# a request from whoever can reach the Prefect server, so it may only tune the run, never say what
# runs or where: hosts, ssh options and proxy commands, paths (run_root, model and data paths),
# entry points, sandbox runtime, storage and tracking URIs, init_from and the promotion gate are not
# on the default list. ``deltaloop run --set`` on the CLI is not checked (the operator's own shell).
API_OVERRIDES_ENV = "DELTALOOP_API_OVERRIDES"
API_OVERRIDES_FILE_ENV = "DELTALOOP_API_OVERRIDES_FILE"
API_CONFIGS_ENV = "DELTALOOP_API_CONFIGS"
DEFAULT_API_OVERRIDES: tuple[str, ...] = (
    "name", "seed", "trainer.*", "warmstart.*", "model.tiny.*", "model.dtype",
    "env.seed", "env.eval_problems", "env.chat", "env.system_prompt", "env.stop", "env.answer.*",
    "env.families", "env.hidden_tests", "env.heldout_fraction",
    "rollout.max_new_tokens", "rollout.temperature", "rollout.top_p",
    "weight_sync.snapshot_chain_fraction", "weight_sync.codec", "weight_sync.zstd_level",
    "loop.*", "eval.every", "eval.max_new_tokens",
)
PROJECT_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class OverrideRefused(ConfigError):
    """A run triggered through a deployment asked for an override, config file or run id it may not use.

    The HTTP analogue is 403: the request is well-formed but not permitted; no retry can help.
    """

    def __init__(self, source: str, problem: str) -> None:
        self.source = source
        self.problems = [problem]
        DeltaloopError.__init__(self, problem)


def api_override_allowlist(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The override keys an API-triggered run may set, as the operator configured them on the worker.

    ``$DELTALOOP_API_OVERRIDES`` (entries separated by commas or spaces) and the lines of the file
    named by ``$DELTALOOP_API_OVERRIDES_FILE`` (``#`` comments) together replace the default list;
    the entry ``default`` stands for :data:`DEFAULT_API_OVERRIDES`. Neither set: the default list.
    An entry is a dotted key (exact) or ``section.*`` (every key under it). An unreadable file
    raises :class:`OverrideRefused` (fail closed).
    """
    env = os.environ if environ is None else environ
    text = env.get(API_OVERRIDES_ENV)
    path = env.get(API_OVERRIDES_FILE_ENV)
    if text is None and not path:
        return DEFAULT_API_OVERRIDES
    entries = re.split(r"[\s,]+", text or "")
    if path:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise OverrideRefused(path, f"cannot read the override allow-list {path} "
                                        f"(${API_OVERRIDES_FILE_ENV}): {exc}") from None
        entries += [w for line in lines for w in re.split(r"[\s,]+", line.split("#", 1)[0])]
    out: list[str] = []
    for e in entries:
        for k in (DEFAULT_API_OVERRIDES if e == "default" else (e,) if e else ()):
            if k not in out:
                out.append(k)
    return tuple(out)


def override_key(item: str) -> str:
    """The dotted key an override ``item`` sets, normalised the way :func:`apply_overrides` reads it."""
    return ".".join(p for p in item.split("=", 1)[0].strip().split(".") if p)


def key_allowed(key: str, allow: tuple[str, ...]) -> bool:
    """Whether dotted ``key`` is an entry of ``allow`` or lies under one of its ``section.*`` entries."""
    return any(key == a or (a.endswith(".*") and key.startswith(a[:-1])) for a in allow)


def check_api_request(config: str | None, overrides: list[str], resume: str | None = None,
                      environ: Mapping[str, str] | None = None) -> None:
    """Refuse what a deployment-triggered run may not ask for, before anything is read or started.

    ``config`` must be a YAML file under the project's ``configs/`` folder or under a path listed in
    ``$DELTALOOP_API_CONFIGS`` (``os.pathsep``-separated files or folders); every override key must
    be allowed by :func:`api_override_allowlist`; ``resume`` must be a plain run id. Raises
    :class:`OverrideRefused` naming the first refused item and what is allowed.
    """
    env = os.environ if environ is None else environ
    roots = [PROJECT_CONFIGS, *(Path(p).resolve() for p in env.get(API_CONFIGS_ENV, "").split(os.pathsep) if p)]
    if config is not None:
        target = Path(config).resolve()
        if target.suffix not in (".yaml", ".yml") or not any(target == r or target.is_relative_to(r) for r in roots):
            raise OverrideRefused(str(config), f"config {config!r} is not allowed for a run triggered through a "
                                  f"deployment: name a YAML file under {PROJECT_CONFIGS} (operators add paths "
                                  f"with ${API_CONFIGS_ENV} on the worker)")
    allow = api_override_allowlist(env)
    for item in overrides:
        key = override_key(str(item))
        if not key_allowed(key, allow):
            raise OverrideRefused(str(config), f"override {key or item!r} is not allowed for a run triggered through "
                                  f"a deployment (allowed: {', '.join(allow) or 'none'}; operators change the "
                                  f"list with ${API_OVERRIDES_ENV} on the worker)")
    if resume is not None and (not _RUN_ID.match(resume) or ".." in resume):
        raise OverrideRefused(str(config), f"resume {resume!r} is not a run id (letters, digits, '_', '.', '-')")


def validate_config(data: dict[str, Any], source: str = "<dict>") -> RunConfig:
    """Validate a plain dict into a :class:`RunConfig` or raise :class:`ConfigError` with all problems."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [_format_error(e) for e in exc.errors()]) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML ``path`` (None = all defaults), apply overrides, validate.

    Raises :class:`ConfigError` listing every problem (missing file, YAML syntax, bad fields).
    """
    source = str(path) if path else "<defaults>"
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(source, [f"{p} is a directory, not a YAML file (e.g. {p / 'demo.yaml'})"])
        if not p.is_file():
            raise ConfigError(source, [f"file not found: {p}"])
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(source, [f"YAML syntax: {exc}"]) from None
        except UnicodeDecodeError as exc:
            raise ConfigError(source, [f"not UTF-8 text (byte {exc.start}): is this a YAML file?"]) from None
        except OSError as exc:
            raise ConfigError(source, [f"cannot read: {exc.strerror or exc}"]) from None
        if not isinstance(loaded, dict):
            raise ConfigError(source, [f"top level must be a mapping, got {type(loaded).__name__}"])
        data = loaded
    problems = apply_overrides(data, overrides or [])
    try:
        cfg = validate_config(data, source)
    except ConfigError as exc:
        raise ConfigError(source, problems + exc.problems) from None
    if problems:
        raise ConfigError(source, problems)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (logged to MLflow and written to the run folder)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
