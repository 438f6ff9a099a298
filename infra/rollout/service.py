"""Handle on the rollout worker process (see :mod:`infra.rollout.server`).

Started once by *provision* through the configured cluster provider
(:meth:`~infra.cluster.base.ClusterProvider.launch_service`), so it runs wherever the provider
places it: this host for ``local``, the first host for ``hosts``. The worker binds its own port and
publishes the address under ``runs/<run>/control/rollout.json``; the URL is the provider's host plus
that port. A worker that does not come up is started once more, then provision fails with one
:class:`~infra.proc.ServiceStartError` line. Per-step tasks call :meth:`RolloutService.load` and
:meth:`RolloutService.rollout`; :meth:`RolloutService.close` stops the process tree, and the worker
also exits by itself when the flow process disappears.

The worker gets only its control token in its environment (:func:`infra.rollout.guard.token_env`:
never the run secret); the control calls send it (``Authorization: Bearer``). A refused call raises
:class:`~infra.rollout.errors.ControlRefused`, any other non-200 answer
:class:`~infra.rollout.errors.RolloutError`, both with the worker's one-line reason.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from infra.config import RunConfig
from infra.proc import ServiceDied, ServiceSpec, describe_exit, http_probe, start_with_retry, tail, wait_until
from infra.rollout.errors import ControlRefused, RolloutError
from infra.rollout.guard import control_token, token_env
from infra.rpc import address_probe
from infra.secrets import run_secret
from infra.specs import RolloutSpec
from infra.storage import ObjectStore, run_key


class RolloutService:
    """One rollout worker process, reached over HTTP at :attr:`url`."""

    def __init__(self, cfg: RunConfig, run_id: str, store: ObjectStore, run_dir: Path,
                 init_dir: str | None = None) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.store = store
        self.run_dir = Path(run_dir)
        self.init_dir = init_dir
        self.address_key = run_key(run_id, None, "control", "rollout.json")
        self.host = "127.0.0.1"
        self.port = 0
        self._handle: Any = None  # infra.cluster.base.ServiceHandle
        self._started = 0.0
        self._log = str(self.run_dir / "logs" / "rollout.log")

    @property
    def url(self) -> str:
        """Base URL of the worker (valid once :meth:`wait_ready` returned)."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Launch the worker and wait until it answers ``/health``."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the worker process through the cluster provider, without waiting for it."""
        from infra.cluster import create_provider

        bind = "127.0.0.1" if self.cfg.cluster.type == "local" else "0.0.0.0"
        spec = RolloutSpec.build(self.cfg, self.run_id, self.store.uri, self.address_key, self.init_dir, bind)
        spec.write(self.run_dir / "rollout_spec.json")
        service = ServiceSpec.python(
            "rollout worker", "infra.rollout.server", [],
            env={**spec.to_env(), **token_env(run_secret(self.run_dir)), "PYTHONUNBUFFERED": "1",
                 "OMP_NUM_THREADS": str(self.cfg.rollout.threads)},
            log=self._log,
        )
        self._started = time.time()
        self._handle = create_provider(self.cfg.cluster).launch_service(service)

    def wait_ready(self) -> None:
        """Wait until the launched worker reports its port and answers ``/health``.

        A worker that dies or does not answer in ``rollout.start_timeout_s`` is started once more;
        then :class:`~infra.proc.ServiceStartError` (one line; the log path in it) is raised."""
        attempt = [0]

        def start() -> None:
            attempt[0] += 1
            if attempt[0] > 1:
                self.launch()
            self._wait_once()

        start_with_retry("rollout worker", start, self._stop)

    def _wait_once(self) -> None:
        timeout = self.cfg.rollout.start_timeout_s
        deadline = time.monotonic() + timeout
        addr = wait_until(address_probe(self.store, self.address_key, self._started - 1), timeout,
                          self.dead_reason, "rollout worker")
        self.host, self.port = self._handle.host, int(addr["port"])
        wait_until(http_probe(self.url + "/health"), max(1.0, deadline - time.monotonic()), self.dead_reason,
                   "rollout worker")

    def dead_reason(self) -> str | None:
        """None while running; else how it ended and the end of its log."""
        if self._handle is None:
            return "rollout worker not started"
        code = self._handle.poll()
        if code is None:
            return None
        return (f"rollout worker on {self._handle.host} stopped: {describe_exit(code)} (log {self._log})\n"
                f"{tail(self._log)}")

    def _post(self, path: str, body: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
        import httpx

        headers = {"Authorization": f"Bearer {control_token(run_secret(self.run_dir))}"}
        try:
            resp = httpx.post(self.url + path, json=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ServiceDied(f"rollout worker {path}: {exc}; {self.dead_reason() or 'still running'}") from exc
        if resp.status_code != 200:
            try:
                reason = str(resp.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                reason = resp.text[:500]
            message = f"rollout worker {path} -> HTTP {resp.status_code}: {reason}"
            if resp.status_code in (401, 403, 404):
                raise ControlRefused(message, resp.status_code)
            raise RolloutError(message)
        return resp.json()

    def load(self, version: int | None = None) -> dict[str, Any]:
        """Make the worker serve ``version`` (None = newest published)."""
        return self._post("/v1/load", {"version": version})

    def rollout(self, prompts_key: str, out_key: str, n: int, temperature: float, max_new_tokens: int,
                seed: int) -> dict[str, Any]:
        """Generate ``n`` samples per prompt; the rollouts land at ``out_key`` in the store."""
        return self._post("/v1/rollout", {"prompts_key": prompts_key, "out_key": out_key, "n": n,
                                          "temperature": temperature, "max_new_tokens": max_new_tokens, "seed": seed})

    def version(self) -> int:
        """Version the worker serves now."""
        import httpx

        return int(httpx.get(self.url + "/v1/version", timeout=10).json()["version"])

    def _stop(self) -> None:
        if self._handle is not None:
            self._handle.terminate(timeout=5.0)
            self._handle = None

    def close(self) -> None:
        """Stop the worker's process tree. Idempotent."""
        self._stop()
