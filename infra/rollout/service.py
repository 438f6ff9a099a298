"""Handle on the rollout worker process (see :mod:`infra.rollout.server`).

Started once by *provision* through the configured cluster provider
(:meth:`~infra.cluster.base.ClusterProvider.launch_service`), so it runs wherever the provider
places it: this host for ``local``, the first host for ``hosts``. The worker binds its own port and
publishes the address under ``runs/<run>/control/rollout.json``; the URL is the provider's host plus
that port. A worker that does not come up is started once more, then provision fails with one
:class:`~infra.proc.ServiceStartError` line. Per-step tasks call :meth:`RolloutService.load` and
:meth:`RolloutService.rollout`; :meth:`RolloutService.close` stops the process tree, and the worker
also exits by itself when the flow process disappears.

A worker that dies (killed, out of memory, its host lost) is replaced by the next control call that
finds it gone: :meth:`RolloutService.restart` starts a fresh process, loads the weight version the
dead one served (never an older or newer one), and the call is sent again as it was — a rollout
batch with the same prompts, seeds and keys, so its samples are the ones the dead worker would have
written (sampling is seeded per row, :func:`infra.rollout.local.row_seed`). Restarts are counted
per run and bounded by ``rollout.max_restarts``; past it the call fails with
:class:`RolloutRestartsExhausted` (not retryable). A worker that is alive but did not answer is not
restarted: that call fails with :class:`~infra.proc.ServiceDied` (retryable).

The worker gets only its control token in its environment (:func:`infra.rollout.guard.token_env`:
never the run secret); the control calls send it (``Authorization: Bearer``). A refused call raises
:class:`~infra.rollout.errors.ControlRefused`, any other non-200 answer
:class:`~infra.rollout.errors.RolloutError`, both with the worker's one-line reason.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from infra.config import RunConfig
from infra.proc import (ServiceDied, ServiceSpec, describe_exit, http_probe, start_with_retry, summarize, tail,
                        wait_until)
from infra.rollout.errors import ControlRefused, RolloutError
from infra.rollout.guard import control_token, token_env
from infra.rpc import address_probe
from infra.secrets import run_secret
from infra.specs import RolloutSpec
from infra.storage import ObjectStore, run_key

log = logging.getLogger(__name__)


class RolloutRestartsExhausted(ServiceDied):
    """The rollout worker died more often than ``rollout.max_restarts`` allows (no more retries)."""

    retryable = False


class RolloutService:
    """One rollout worker process, reached over HTTP at :attr:`url`; replaced when it dies.

    ``report`` receives one line per restart (the flow passes its progress printer)."""

    #: how long the worker waits for a version it is told to load to be committed in the store: 0
    #: here, where a version is loaded only once committed (the broadcast placement's is longer)
    store_wait_s = 0.0

    def __init__(self, cfg: RunConfig, run_id: str, store: ObjectStore, run_dir: Path,
                 init_dir: str | None = None, report: Callable[[str], None] | None = None) -> None:
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
        self.report: Callable[[str], None] = report or log.warning
        self.restarts = 0  # workers replaced in this run
        self.served: int | None = None  # weight version the worker serves (what a replacement loads)
        self._generation = 0  # bumped per replacement: a caller that saw an older one finds it replaced
        self._restart_lock = threading.Lock()
        self._closed = False
        self._secret = run_secret(self.run_dir)  # read once: the worker's token and our bearer header
        self._vllm_checked: str | None = None  # the vLLM interpreter that passed its check

    @property
    def url(self) -> str:
        """Base URL of the worker (valid once :meth:`wait_ready` returned)."""
        return f"http://{self.host}:{self.port}"

    @property
    def where(self) -> str:
        """Where rollouts are generated, for progress lines."""
        return f"worker at {self.url}"

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
        env = {**spec.to_env(), **token_env(self._secret), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(self.cfg.rollout.threads)}
        if self.cfg.rollout.type == "vllm":  # vLLM's own environment (infra.rollout.vllm_env)
            service = ServiceSpec(name="rollout worker", argv=[self._vllm_python(), "-m", "infra.rollout.server"],
                                  env=env, log=self._log)
        else:
            service = ServiceSpec.python("rollout worker", "infra.rollout.server", [], env=env, log=self._log)
        self._started = time.time()
        self._handle = create_provider(self.cfg.cluster).launch_service(service)

    def _vllm_python(self) -> str:
        """vLLM's interpreter, checked once per service (:func:`infra.rollout.vllm_env.check_vllm_python`)
        when the worker runs on this host; on another host (``cluster.type`` other than ``local``)
        the path is the remote one and a broken environment shows as a worker that does not start."""
        from infra.rollout.vllm_env import check_vllm_python, vllm_python

        python = vllm_python(self.cfg.rollout.vllm_python)
        if self.cfg.cluster.type == "local" and self._vllm_checked != python:
            version = check_vllm_python(python)
            log.info("rollout worker: vLLM %s under %s", version, python)
            self._vllm_checked = python
        return python

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

    @property
    def pid(self) -> int | None:
        """Pid of the worker process when it runs on this host (None when not started or remote)."""
        return getattr(self._handle, "pid", None)

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

        headers = {"Authorization": f"Bearer {control_token(self._secret)}"}
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

    def _gone(self, grace_s: float = 2.0) -> bool:
        """True if the worker process has exited. A killed process closes its sockets moments before
        it can be reaped, so a broken connection waits up to ``grace_s`` for the exit to show."""
        deadline = time.monotonic() + grace_s
        while True:
            if self._handle is None or self._handle.poll() is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _control(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a control call; if the worker died, replace it (:meth:`restart`) and send it again."""
        while True:
            generation = self._generation
            try:
                return self._post(path, body)
            except ServiceDied as exc:
                if self._closed or not self._gone():
                    raise
                self.restart(str(exc), generation)

    def restart(self, reason: str, generation: int | None = None) -> None:
        """Replace a dead worker: a fresh process that serves the version the dead one served.

        ``generation``: the replacement count the caller saw before its call failed; if another
        caller has replaced the worker since, nothing is done. Raises
        :class:`RolloutRestartsExhausted` once ``rollout.max_restarts`` replacements were made."""
        with self._restart_lock:
            if generation is not None and generation != self._generation:
                return
            while True:
                limit = self.cfg.rollout.max_restarts
                if self.restarts >= limit:
                    raise RolloutRestartsExhausted(
                        f"rollout worker died again after {self.restarts} restart(s) (rollout.max_restarts={limit}): "
                        f"{summarize(reason)}")
                self.restarts += 1
                self.report(f"rollout worker died ({summarize(reason)}); restart {self.restarts}/{limit}"
                            + (f" with weights v{self.served}" if self.served is not None else ""))
                self._stop()
                self.store.delete(self.address_key)  # only the new worker's address may be read
                self.launch()
                self.wait_ready()
                self._generation += 1
                if self.served is None:
                    return
                try:
                    self._post("/v1/load", {"version": self.served, "wait_s": self.store_wait_s})
                    return
                except ServiceDied as exc:
                    if not self._gone():
                        raise
                    reason = str(exc)

    def bind_trainer(self, trainer: Any) -> None:
        """Called once the trainer group is up (and after a replacement); the worker pulls versions
        from the store and needs nothing from it (placements that do override this)."""

    def load(self, version: int | None = None) -> dict[str, Any]:
        """Make the worker serve ``version`` (None = newest published; waiting up to
        :attr:`store_wait_s` for it to be committed in the store)."""
        res = self._control("/v1/load", {"version": version, "wait_s": self.store_wait_s})
        self.served = int(res["version"])
        return res

    def rollout(self, prompts_key: str, out_key: str, n: int, temperature: float, max_new_tokens: int,
                seed: int) -> dict[str, Any]:
        """Generate ``n`` samples per prompt; the rollouts land at ``out_key`` in the store."""
        return self._control("/v1/rollout", {"prompts_key": prompts_key, "out_key": out_key, "n": n,
                                             "temperature": temperature, "max_new_tokens": max_new_tokens,
                                             "seed": seed})

    def version(self) -> int:
        """Version the worker serves now."""
        import httpx

        return int(httpx.get(self.url + "/v1/version", timeout=10).json()["version"])

    def _stop(self) -> None:
        if self._handle is not None:
            self._handle.terminate(timeout=5.0)
            self._handle = None

    def close(self) -> None:
        """Stop the worker's process tree (and replace it no more). Idempotent."""
        self._closed = True
        self._stop()
