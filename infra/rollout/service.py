"""Handle on a rollout worker process (see :mod:`infra.rollout.server`).

Started once by *provision*; per-step tasks call :meth:`RolloutService.load` and
:meth:`RolloutService.rollout`. :meth:`RolloutService.close` terminates the process group, and the
worker also exits by itself when the flow process disappears.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from infra.cluster.base import free_port
from infra.config import RunConfig
from infra.rpc import ServiceDied
from infra.storage import ObjectStore


class RolloutService:
    """One rollout worker process on this host, reached over HTTP on loopback."""

    def __init__(self, cfg: RunConfig, run_id: str, store: ObjectStore, run_dir: Path,
                 init_dir: str | None = None) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.store = store
        self.run_dir = Path(run_dir)
        self.init_dir = init_dir
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self._log = str(self.run_dir / "logs" / "rollout.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Launch the worker and wait until it answers ``/health``."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the worker process without waiting for it."""
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        spec = {"config": self.cfg.model_dump(mode="json"), "run_id": self.run_id, "store_uri": self.store.uri,
                "endpoint_url": self.cfg.storage.endpoint_url, "region": self.cfg.storage.region,
                "init_dir": self.init_dir}
        spec_path = self.run_dir / "rollout_spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        self.port = free_port()
        env = {**os.environ, "DELTALOOP_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(self.cfg.rollout.threads)}
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "infra.rollout.server", "--spec", str(spec_path), "--port", str(self.port)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def wait_ready(self) -> None:
        """Wait until the launched worker answers ``/health``; raises ServiceDied with its log."""
        import httpx

        deadline = time.monotonic() + self.cfg.rollout.start_timeout_s
        while time.monotonic() < deadline:
            dead = self.dead_reason()
            if dead:
                raise ServiceDied(dead)
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ServiceDied(f"rollout worker did not answer within {self.cfg.rollout.start_timeout_s:.0f}s; log {self._log}")

    def dead_reason(self) -> str | None:
        """None while running; else the exit code and the end of the log."""
        if self._proc is None:
            return "rollout worker not started"
        code = self._proc.poll()
        if code is None:
            return None
        try:
            tail = "\n".join(Path(self._log).read_text(errors="replace").splitlines()[-30:])
        except OSError:
            tail = ""
        return f"rollout worker exited with code {code}\n{tail}"

    def _post(self, path: str, body: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
        import httpx

        try:
            resp = httpx.post(self.url + path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise ServiceDied(f"rollout worker {path}: {exc}; {self.dead_reason() or 'still running'}") from exc
        if resp.status_code != 200:
            raise RuntimeError(f"rollout worker {path} -> HTTP {resp.status_code}: {resp.text[:500]}")
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

    def close(self) -> None:
        """Terminate the worker's process group. Idempotent."""
        if self._proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self._proc.poll() is not None:
                break
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                continue
        self._proc = None
