"""The champion, served: an OpenAI-compatible endpoint over the registry alias that follows it.

``python -m infra.ops.champion_server`` (started by ``deltaloop serve --champion``) downloads the
version ``NAME@ALIAS`` points to (:meth:`infra.registry.Registry.download`), loads it into an
engine and serves ``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``
(the served model name is the registered model's name) plus an open ``GET /health``.

Following the alias: a poller reads the alias every ``--poll`` seconds (default 2). When it
points at another version (a promotion, a rollback, a hand-made move) that version is downloaded
and loaded into a *second* engine while the first keeps answering; then the reference to the
served engine is swapped in one assignment on the event loop. A request picks its engine once,
when it arrives, and finishes on it: in-flight requests end on the old weights, new ones get the
new weights, none is refused or dropped, and the process never restarts. The old engine is closed
once its last request has finished. A version that fails to load leaves the old one serving
(``last_error`` in ``/health``) and is retried at the next poll. Every answer names the registry
version that produced it in the header ``x-deltaloop-model-version`` (and ``/v1/models`` lists it
as ``version``); ``/health`` records each swap (``from``, ``to``, ``seconds`` from the moment the
poller saw the alias move until new requests went to the new version).

Engines (``--engine``): ``local`` (CPU or one GPU) is :class:`infra.rollout.local.LocalEngine`
behind the rollout worker's own OpenAI frontend (:func:`infra.rollout.openai_api.create_app`: the
same request checks, limits and error shapes); its ``weight_version`` / ``system_fingerprint``
fields carry the registry version. ``vllm`` (GPUs) runs vLLM's own OpenAI server
(:func:`infra.rollout.vllm_engine.openai_app`) over an AsyncLLM per version and runs under vLLM's
interpreter (``DELTALOOP_VLLM_PYTHON`` / ``.venv-vllm``, which then also needs ``mlflow`` for the
registry; ``deltaloop serve`` picks that interpreter); the swap is the same. That path is wired,
not exercised by the tests (they run on CPU, local engine). While two versions
are loaded the process holds both (twice the model's memory for the few seconds of a swap).

Auth follows ``deltaloop serve`` (:mod:`infra.serve`): with an auth string ``user:password`` in
``$DELTALOOP_CHAMPION_AUTH`` (never argv) every path but ``/health`` needs either HTTP basic auth
with that string or ``Authorization: Bearer <key>``, the key being
:func:`infra.serve.champion_api_key` of the string
(what an OpenAI client passes as ``api_key``; it cannot be used against Prefect or MLflow). Without
one the server refuses any non-loopback address. Registry reads use MLflow's own client
credentials (``MLFLOW_TRACKING_USERNAME``/``PASSWORD``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hmac
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from infra.backends import Registry as BackendRegistry
from infra.errors import DeltaloopError
from infra.rollout.guard import send_error, send_json
from infra.serve import CHAMPION_AUTH_ENV as AUTH_ENV
from infra.serve import champion_api_key as api_key
from infra.serve import is_loopback

if TYPE_CHECKING:
    from infra.config import RolloutConfig
    from infra.registry import Registry

log = logging.getLogger(__name__)

VERSION_HEADER = "x-deltaloop-model-version"
ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


class ChampionError(DeltaloopError):
    """The champion server cannot start as asked (bad address, no auth off loopback)."""

    retryable = False


@dataclass(eq=False)
class Served:
    """One loaded registry version: the ASGI app answering for it and how to close it."""

    version: str
    app: ASGIApp
    close: Callable[[], Awaitable[None]]
    folder: Path
    inflight: int = 0
    loaded_at: float = field(default_factory=time.time)


# ----------------------------------------------------------------------------- engines
async def _noop() -> None:
    return None


def _load_model(folder: Path) -> tuple[Any, Any]:
    from infra.config import ModelConfig
    from infra.model import load_policy

    return load_policy(ModelConfig(), folder=folder)


class LocalBackend:
    """Each version in a :class:`~infra.rollout.local.LocalEngine` behind the rollout OpenAI frontend."""

    def __init__(self, cfg: "RolloutConfig", model_name: str) -> None:
        self.cfg, self.model_name = cfg, model_name

    async def load(self, folder: Path, version: str) -> Served:
        def build() -> ASGIApp:
            import torch

            from infra.rollout import create_engine
            from infra.rollout.openai_api import ApiLimits, create_app

            torch.set_num_threads(self.cfg.threads)
            model, tokenizer = _load_model(folder)
            engine = create_engine(self.cfg, model, tokenizer)
            engine.version = int(version)  # weight_version / system_fingerprint name the registry version
            return create_app(engine, self.model_name, limits=ApiLimits.of(self.cfg))

        return Served(version, await asyncio.to_thread(build), _noop, folder)


class VLLMBackend:
    """Each version in its own vLLM AsyncLLM behind vLLM's OpenAI server (vLLM's interpreter)."""

    def __init__(self, cfg: "RolloutConfig", model_name: str) -> None:
        self.cfg, self.model_name = cfg, model_name

    async def load(self, folder: Path, version: str) -> Served:
        from infra.rollout.vllm_engine import openai_app, start_engine

        model, tokenizer = await asyncio.to_thread(_load_model, folder)
        engine = await start_engine(model, tokenizer, self.cfg, 0, self.model_name)
        del model
        return Served(version, await openai_app(engine), engine.aclose, folder)


BACKENDS: BackendRegistry[Any] = BackendRegistry("champion engine", {"local": LocalBackend, "vllm": VLLMBackend})


# ----------------------------------------------------------------------------- the server
class ChampionServer:
    """ASGI app serving ``NAME@alias``; :meth:`refresh` follows the alias (see the module docstring)."""

    def __init__(self, registry: "Registry", alias: str, backend: Any, workdir: Path,
                 auth: str | None = None, keep_folders: int = 2) -> None:
        self.registry, self.alias, self.backend = registry, alias, backend
        self.workdir = Path(workdir)
        self.auth = auth
        self.keep_folders = keep_folders
        self.current: Served | None = None
        self.loading: str | None = None
        self.swaps: list[dict[str, Any]] = []
        self.last_error: str | None = None
        self.started = int(time.time())
        self._retiring: set[asyncio.Task] = set()

    # ---- following the alias
    async def refresh(self) -> bool:
        """Swap to the version the alias points to if it moved; True when a swap happened."""
        info = await asyncio.to_thread(self.registry.alias, self.alias)
        if info is None or (self.current is not None and info.version == self.current.version):
            return False
        seen = time.perf_counter()
        self.loading = info.version
        try:
            served = await self._load(info.version)
        finally:
            self.loading = None
        old, self.current = self.current, served  # new requests go to the new version from here
        seconds = time.perf_counter() - seen
        self.swaps.append({"from": old.version if old else None, "to": served.version, "seconds": round(seconds, 3),
                           "at": time.time()})
        log.warning("champion: serving %s version %s (was %s), loaded in %.1fs", self.registry.name,
                    served.version, old.version if old else "none", seconds)
        if old is not None:
            task = asyncio.get_running_loop().create_task(self._retire(old))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        return True

    async def _load(self, version: str) -> Served:
        dst = self.workdir / f"v{int(version):06d}"
        if not (dst / "complete").is_file():  # versions are immutable: a finished download is reused
            shutil.rmtree(dst, ignore_errors=True)
            folder = await asyncio.to_thread(self.registry.download, version, dst / "dl")
            (dst / "folder").write_text(str(Path(folder).relative_to(dst)))
            (dst / "complete").write_text("")
        folder = dst / (dst / "folder").read_text()
        return await self.backend.load(folder, version)

    async def _retire(self, old: Served) -> None:
        """Close ``old`` once its last request has finished; prune download folders."""
        while old.inflight:
            await asyncio.sleep(0.05)
        await old.close()
        keep = {p for s in self.swaps[-self.keep_folders:] for p in (s["to"], s["from"]) if p}
        for path in self.workdir.glob("v*"):
            if path.name.lstrip("v").lstrip("0") not in keep:
                shutil.rmtree(path, ignore_errors=True)

    async def poll_forever(self, interval_s: float) -> None:
        """:meth:`refresh` every ``interval_s``; a failure is logged and retried at the next poll."""
        while True:
            try:
                await self.refresh()
                self.last_error = None
            except Exception as exc:  # registry down, corrupt version: keep serving what we have
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("champion: cannot follow %s@%s: %s", self.registry.name, self.alias, self.last_error)
            await asyncio.sleep(interval_s)

    # ---- HTTP
    def health(self) -> dict[str, Any]:
        cur = self.current
        return {"ok": True, "model": self.registry.name, "alias": self.alias, "version": cur.version if cur else None,
                "loading": self.loading, "swaps": self.swaps[-20:], "last_error": self.last_error, "pid": os.getpid()}

    def models(self) -> dict[str, Any]:
        cur = self.current
        data = [] if cur is None else [{"id": self.registry.name, "object": "model", "created": int(cur.loaded_at),
                                        "owned_by": "deltaloop", "version": cur.version, "alias": self.alias}]
        return {"object": "list", "data": data}

    def authorized(self, header: bytes | None) -> bool:
        """Whether an ``Authorization`` header carries the basic auth string or the bearer key."""
        if self.auth is None:
            return True
        scheme, _, given = (header or b"").decode("latin-1").partition(" ")
        given = given.strip()
        if scheme.lower() == "bearer":
            return hmac.compare_digest(given.encode(), api_key(self.auth).encode())
        if scheme.lower() == "basic":
            try:
                return hmac.compare_digest(base64.b64decode(given, validate=True), self.auth.encode())
            except ValueError:
                return False
        return False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            await send_json(send, 200, self.health())
            return
        if not self.authorized(dict(scope.get("headers") or []).get(b"authorization")):
            await send_error(send, 401, "missing or wrong credentials (serve's auth string as HTTP basic, "
                             "or its champion API key as bearer)", "unauthorized",
                             [(b"www-authenticate", b'Bearer, Basic realm="deltaloop"')])
            return
        if path == "/v1/models":
            await send_json(send, 200, self.models())
            return
        served = self.current
        if served is None:
            await send_error(send, 503, f"no version of {self.registry.name!r} has the alias {self.alias!r} yet",
                             "model_not_ready")
            return
        await self._dispatch(served, scope, receive, send)

    async def _dispatch(self, served: Served, scope: dict, receive: Callable, send: Callable) -> None:
        """Run the request on ``served`` (picked once), naming its version in a response header."""
        header = (VERSION_HEADER.encode(), served.version.encode())

        async def send_versioned(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), header]}
            await send(msg)

        served.inflight += 1
        try:
            await served.app(scope, receive, send_versioned)
        finally:
            served.inflight -= 1


# ----------------------------------------------------------------------------- process
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Serve NAME@ALIAS over the OpenAI API and follow the alias.")
    p.add_argument("--tracking-uri", required=True, help="MLflow tracking/registry URI.")
    p.add_argument("--model", default="deltaloop-policy", help="Registered model name (the served model id).")
    p.add_argument("--alias", default="champion")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (see --state-file).")
    p.add_argument("--engine", default="local", help=f"one of {sorted(BACKENDS.names())}")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads (local).")
    p.add_argument("--poll", type=float, default=2.0, help="Seconds between reads of the alias.")
    p.add_argument("--workdir", type=Path, required=True, help="Download cache of served versions.")
    p.add_argument("--state-file", type=Path, default=None, help="Written once listening: host, port, pid.")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    """Bind, load the current champion (if any), then serve and follow the alias until killed."""
    import uvicorn

    from infra.atomicio import write_json_atomic
    from infra.config import RolloutConfig
    from infra.proc import bind_socket
    from infra.registry import Registry

    auth = os.environ.pop(AUTH_ENV, None) or None
    if auth is None and not is_loopback(args.host):
        raise ChampionError(f"refusing to serve the champion on {args.host} without auth (${AUTH_ENV})")
    cfg = RolloutConfig(type=args.engine, threads=args.threads)
    backend = BACKENDS.create(args.engine, cfg, args.model)
    server = ChampionServer(Registry(args.tracking_uri, args.model), args.alias, backend, args.workdir, auth)
    sock = bind_socket(args.host, args.port)
    try:
        await server.refresh()
    except Exception as exc:  # serve anyway (503 until a version loads); the poller retries
        server.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("champion: initial load failed: %s", server.last_error)
    poller = asyncio.get_running_loop().create_task(server.poll_forever(args.poll))
    if args.state_file:
        write_json_atomic(args.state_file, {"host": args.host, "port": sock.getsockname()[1], "pid": os.getpid()})
    try:
        await uvicorn.Server(uvicorn.Config(server, lifespan="off", log_level="warning")).serve(sockets=[sock])
    finally:
        poller.cancel()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
