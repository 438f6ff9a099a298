"""The trainer as a long-lived service: N ranks started once, driven by commands.

:class:`TrainerService` launches ``infra.train.worker`` on every rank through the configured cluster
provider (``local`` torchrun by default), waits for rank 0 to publish its control address in the
object store, and then sends one command per pipeline stage (``init``, ``warmstart``, ``publish``,
``train_step``, ``export``). Nothing reloads the model per step.

Each rank gets an :class:`infra.specs.TrainerSpec` in its environment: the trainer's sections of the
resolved run config and the run's identity, built once here. A group that does not come up is
started once more, then :class:`~infra.proc.ServiceStartError` (one line) is raised.

If the group dies (a rank is killed, a host is lost), calls raise :class:`~infra.rpc.ServiceDied`;
:func:`infra.stages.provision.restart_trainer` then starts a fresh group and restores the newest
checkpoint, and the train stage replays the steps after it (see docs/training.md).

Teardown (:meth:`TrainerService.close`) asks for a clean shutdown, then kills the whole process
group; every rank also exits on its own if the flow process that started it disappears, so no
rank outlives its flow.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from infra.cluster.base import GroupHandle
from infra.config import RunConfig
from infra.proc import ServiceDied, start_with_retry, tail
from infra.rpc import RpcClient, control_key
from infra.secrets import run_secret, secret_env
from infra.specs import TrainerSpec
from infra.storage import ObjectStore, run_key


class TrainerRestartsExhausted(ServiceDied):
    """The trainer group died more often than ``trainer.max_restarts`` allows (no more retries)."""

    retryable = False


class TrainerService:
    """Handle on the running trainer process group."""

    def __init__(
        self,
        cfg: RunConfig,
        run_id: str,
        store: ObjectStore,
        run_dir: Path,
        init_dir: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.store = store
        self.run_dir = Path(run_dir)
        self.init_dir = init_dir
        self.control_key = run_key(run_id, None, "control", "trainer.json")
        self._handle: GroupHandle | None = None
        self._client: RpcClient | None = None
        self._logs: list[str] = []
        self._provider: Any = None
        self.health: Any = None  # infra.cluster.health.HealthReport once checked

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Launch every rank and connect to rank 0; a failed start is retried once, then raises
        :class:`~infra.proc.ServiceStartError`."""
        start_with_retry("trainer", self._start_once, self._stop_group)

    def _start_once(self) -> None:
        spec = TrainerSpec.build(self.cfg, self.run_id, self.store.uri, self.control_key, self.run_dir, self.init_dir)
        spec.write(self.run_dir / "trainer_spec.json")
        env = {
            **spec.to_env(),
            **secret_env(run_secret(self.run_dir)),
            "DELTALOOP_PARENT_PID": str(os.getpid()),
            "PYTHONUNBUFFERED": "1",
        }
        if self._provider is None:
            # health checks run once, before the first launch: a failing or slow node is named
            # (and replaced where the provider has spares) before any training time is spent
            from infra.cluster.health import provision as provision_group

            self._provider, self.health = provision_group(self.cfg.cluster, str(self.run_dir / "logs"))
        started = time.time()
        self._handle = self._provider.launch("infra.train.worker", [], env, str(self.run_dir / "logs"))
        self._logs = list(getattr(self._handle, "logs", []))
        self._client = RpcClient.connect(self.store, self.control_key, control_key(self.run_dir),
                                         self.cfg.cluster.start_timeout_s, self.dead_reason, started - 1)

    def reconnect(self) -> None:
        """Drop the control connection and connect to the running group again (its state is kept).

        Rank 0 serves a new controller whenever the previous connection ended, so a broken
        connection need not cost a restart from the last checkpoint."""
        if self._handle is None:
            raise ServiceDied("trainer service is not running")
        if self._client is not None:
            self._client.close()
            self._client = None
        self._client = RpcClient.connect(self.store, self.control_key, control_key(self.run_dir),
                                         self.cfg.cluster.start_timeout_s, self.dead_reason)

    def dead_reason(self) -> str | None:
        """None while the group runs; else why it stopped, with the end of its log."""
        if self._handle is None:
            return "trainer not started"
        code = self._handle.poll()
        if code is None:
            return None
        tails = "\n".join(tail(p) for p in self._logs)
        return f"trainer group exited with code {code} ({self._handle.describe()})\n{tails}"

    def call(self, op: str, timeout_s: float = 3600.0, **kwargs: Any) -> dict:
        """Run one command on every rank; returns rank 0's reply."""
        if self._client is None:
            raise ServiceDied("trainer service is not running")
        return self._client.call(op, self.dead_reason, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        """Shut down cleanly if possible, then make sure no rank survives. Idempotent."""
        if self._client is not None:
            try:
                if self._handle is not None and self._handle.poll() is None:
                    self._client.call("shutdown", self.dead_reason, timeout_s=15)
            except Exception:  # teardown must go on whatever the trainer says
                pass
            self._client.close()
            self._client = None
        if self._handle is not None:
            deadline = time.monotonic() + 5
            while self._handle.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        self._stop_group()

    def _stop_group(self) -> None:
        if self._handle is not None:
            self._handle.terminate()
            self._handle = None

    def __enter__(self) -> "TrainerService":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
