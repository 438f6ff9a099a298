"""What each service process is told: its part of the run config, resolved once, as typed JSON.

The flow parses the config (YAML plus ``--set`` overrides) once. A service process does not get the
whole :class:`~infra.config.RunConfig` nor the overrides: :meth:`TrainerSpec.build` and
:meth:`RolloutSpec.build` cut the sections that process uses out of the resolved config, add the
run's identity (run id, store, where to report its address), and the process reads them back with
:meth:`read` — validated by the same pydantic section models, nothing parsed twice.

* trainer ranks (:mod:`infra.train.worker`): ``seed``, ``model``, ``warmstart``, ``cluster``,
  ``trainer``, ``rollout`` (the sampling temperature of the log-probs), ``weight_sync``, and the
  run's config hash for checkpoint metadata (the warm-start examples come through the store);
* rollout worker (:mod:`infra.rollout.server`): ``seed``, ``model``, ``rollout``, ``weight_sync``.

The spec travels in the process's environment (``DELTALOOP_SPEC``, :meth:`to_env`): a cluster provider
carries the environment to every host (the ``hosts`` agent reads it from ssh's stdin, ``kubernetes``
puts it in a Secret), so no shared filesystem is needed. The service also writes it to the run
folder for people to read; ``--spec FILE`` runs a process by hand from such a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict

from infra.atomicio import write_atomic

from infra.config import (ClusterConfig, ModelConfig, RolloutConfig, RunConfig, TrainerConfig,
                          WarmstartConfig, WeightSyncConfig)

S = TypeVar("S", bound="_Spec")
SPEC_ENV = "DELTALOOP_SPEC"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def write(self, path: Path) -> Path:
        """Write the spec as JSON to ``path`` (the file passed to the process as ``--spec``)."""
        write_atomic(path, self.model_dump_json(indent=1))  # (a relaunch rewrites it)
        return path

    def to_env(self) -> dict[str, str]:
        """The environment entry that carries this spec to the process."""
        return {SPEC_ENV: self.model_dump_json()}

    @classmethod
    def read(cls: type[S], path: str | Path | None = None) -> S:
        """Read and validate the spec from ``path`` (written by :meth:`write`), else from
        ``$DELTALOOP_SPEC`` (set by :meth:`to_env`)."""
        if path:
            return cls.model_validate_json(Path(path).read_text())
        raw = os.environ.get(SPEC_ENV)
        if not raw:
            raise ValueError(f"no spec: pass --spec FILE or set {SPEC_ENV}")
        return cls.model_validate_json(raw)


class StoreRef(_Spec):
    """How a process opens the run's object store: ``infra.storage.open_store(**ref.model_dump())``."""

    uri: str
    endpoint_url: str | None = None
    region: str | None = None

    @classmethod
    def of(cls, uri: str, cfg: RunConfig) -> "StoreRef":
        """The store at ``uri``, reached with ``cfg.storage``'s endpoint and region."""
        return cls(uri=uri, endpoint_url=cfg.storage.endpoint_url, region=cfg.storage.region)


class TrainerSections(_Spec):
    """The config sections a trainer rank uses (same names as in :class:`RunConfig`)."""

    seed: int
    model: ModelConfig
    warmstart: WarmstartConfig
    cluster: ClusterConfig
    trainer: TrainerConfig
    rollout: RolloutConfig
    weight_sync: WeightSyncConfig
    run_config_hash: str

    def config_hash(self) -> str:
        """Hash of the whole run config (the lineage tag written with every checkpoint)."""
        return self.run_config_hash


class TrainerSpec(_Spec):
    """Everything a trainer rank needs: its config sections and the run's identity."""

    config: TrainerSections
    run_id: str
    store: StoreRef
    control_key: str  # rank 0 publishes its control address here
    init_dir: str | None = None  # a registered model downloaded by provision (None: build from config)
    run_dir: str

    @classmethod
    def build(cls, cfg: RunConfig, run_id: str, store_uri: str, control_key: str, run_dir: Path,
              init_dir: str | None = None) -> "TrainerSpec":
        """Cut the trainer's sections out of the resolved run config."""
        sections = TrainerSections(
            seed=cfg.seed, model=cfg.model, warmstart=cfg.warmstart, cluster=cfg.cluster,
            trainer=cfg.trainer, rollout=cfg.rollout, weight_sync=cfg.weight_sync,
            run_config_hash=cfg.config_hash(),
        )
        return cls(config=sections, run_id=run_id, store=StoreRef.of(store_uri, cfg), control_key=control_key,
                   init_dir=init_dir, run_dir=str(run_dir))


class RolloutSections(_Spec):
    """The config sections the rollout worker uses."""

    seed: int
    model: ModelConfig
    rollout: RolloutConfig
    weight_sync: WeightSyncConfig


class RolloutSpec(_Spec):
    """Everything the rollout worker needs: its config sections, the run, where to listen and report."""

    config: RolloutSections
    run_id: str
    store: StoreRef
    address_key: str  # the worker publishes {"host", "port"} here once its socket is bound
    bind: str = "127.0.0.1"  # interface to listen on (all interfaces when placed on another host)
    port: int = 0  # 0: any free port, reported through address_key
    init_dir: str | None = None
    model_name: str = "policy"  # served model name of the OpenAI-compatible API

    @classmethod
    def build(cls, cfg: RunConfig, run_id: str, store_uri: str, address_key: str = "",
              init_dir: str | None = None, bind: str = "127.0.0.1") -> "RolloutSpec":
        """Cut the rollout worker's sections out of the resolved run config."""
        sections = RolloutSections(seed=cfg.seed, model=cfg.model, rollout=cfg.rollout, weight_sync=cfg.weight_sync)
        return cls(config=sections, run_id=run_id, store=StoreRef.of(store_uri, cfg), address_key=address_key,
                   init_dir=init_dir, bind=bind)
