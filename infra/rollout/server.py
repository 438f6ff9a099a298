"""The rollout worker: one process holding an inference engine, served over HTTP.

Started once by *provision* through the cluster provider (``python -m infra.rollout.server``, with
an :class:`infra.specs.RolloutSpec` — the worker's config sections and the run — in its
environment, or ``--spec FILE``), it keeps the model in memory for the whole run. It binds its own
listening socket (``spec.port``, 0 = any free port) first, loads the model, and then publishes the
address it got at ``spec.address_key`` in the object store: no port is chosen by one process and
bound by another, and the flow finds the worker wherever the provider placed it (loopback for
``local``). Each new policy version is pulled from the weight-sync store and applied in place
(``POST /v1/load``); every batch it generates records the version that produced it. Prompts and
rollouts travel through the object store (data plane); HTTP carries only keys and small results
(control plane).

Stale-weight rules: a version the worker cannot apply (corrupt or missing object, the store
unreachable) leaves it serving the version it has; the ``/v1/load`` answer says so (``applied:
false``, ``requested``, ``error``), a warning is logged, and ``load_failures`` / ``last_load_error``
in ``/health`` count it. It never moves to an older version than the one it serves: such a load is
refused (409) and counted in ``refused_older``.

Endpoints: ``GET /health``, ``GET /v1/version``, ``POST /v1/load``, ``POST /v1/rollout``,
``POST /v1/weights/digest`` (per-tensor sha256 of the weights served, :mod:`infra.rollout.digest`),
``POST /v1/broadcast/join`` and ``/v1/broadcast/load`` (versions received from trainer rank 0 instead
of the store, ``weight_sync.placement: broadcast``: :mod:`infra.rollout.broadcast_link`),
and the OpenAI-compatible ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(:mod:`infra.rollout.openai_api`; served model name ``spec.model_name``, default ``policy``) for
agent harnesses and multi-turn environments. OpenAI requests do not take the worker lock: they join
the engine's continuous batch, and the engine itself keeps weight loads between requests. With
``rollout.type: vllm`` the worker runs under vLLM's interpreter (:mod:`infra.rollout.vllm_env`), the
OpenAI endpoints are vLLM's own server (:func:`infra.rollout.vllm_engine.openai_app`) and versions
are fetched and applied inside vLLM's model process (:mod:`infra.rollout.vllm_ext`); a load there
lands between two engine steps, so an OpenAI request in flight may finish on the new weights.

Guards (:mod:`infra.rollout.guard`): every body is capped at ``rollout.max_body_bytes`` (413); the
control endpoints ``/v1/load`` and ``/v1/rollout`` need the run's bearer token, derived from the run
secret and handed to the worker alone in ``$DELTALOOP_ROLLOUT_TOKEN`` (the worker never holds the run
secret, and does not start without its token), take only store keys in
the run's rollout areas (401/403) and only versions that are committed (404); OpenAI requests are
checked against ``rollout.max_request_*`` / ``max_stop*`` before they join the batch (400).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

from infra.errors import DeltaloopError
from infra.lifeline import exit_with_parent
from infra.rollout.batch import prompt_batch, sample_records, write_rollouts
from infra.rollout.errors import BadRequest, ControlRefused
from infra.rollout.guard import check_rollout_key
from infra.specs import RolloutSpec
from infra.storage import ObjectNotFound, ObjectStore, get_json, open_store, run_key

log = logging.getLogger(__name__)


class RolloutWorker:
    """Engine + weight reader; generation and weight loads are serialised by one lock."""

    def __init__(self, spec: RolloutSpec, engine_factory: Callable[..., Any] | None = None) -> None:
        import torch

        from infra.model import load_policy
        from infra.rollout import create_engine
        from infra.weightsync import VersionReader

        cfg = spec.config
        torch.set_num_threads(cfg.rollout.threads)
        self.cfg = cfg
        self.store: ObjectStore = open_store(**spec.store.model_dump())
        model, tokenizer = load_policy(cfg.model, seed=cfg.seed, folder=spec.init_dir or None)
        model.eval()
        self.engine = (engine_factory or create_engine)(cfg.rollout, model, tokenizer)
        self.tokenizer = tokenizer
        self.run_id = spec.run_id
        # a version is the policy's weights: one declaring more than twice what the loaded model
        # holds (fp32 master copy vs bf16 serving, plus margin) is refused before any allocation
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        prefix, max_bytes = run_key(spec.run_id, None, "weights"), 2 * model_bytes + (64 << 20)
        self.reader = VersionReader(self.store, prefix, threads=cfg.weight_sync.threads, max_bytes=max_bytes)
        # engines that fetch versions inside a process of their own (vLLM) get the store there
        self.remote_weights = bool(getattr(self.engine, "remote_weights", False))
        if self.remote_weights:
            self.engine.attach(spec.store.model_dump(), prefix, cfg.weight_sync.threads, max_bytes)
        self._tensors: dict[str, Any] | None = None
        self._lock = threading.Lock()
        from infra.rollout.broadcast_link import BroadcastLink

        self.broadcast = BroadcastLink(self, spec.bind, max_bytes)  # weight_sync.placement: broadcast
        self.load_failures = 0  # loads of a version that could not be applied (the old one kept serving)
        self.refused_older = 0  # loads refused because the version was older than the one served
        self.last_load_error: str | None = None

    @property
    def version(self) -> int:
        return int(getattr(self.engine, "version", 0) or 0)

    def status(self) -> dict[str, Any]:
        """The version served and the load counters (``/health``)."""
        return {"version": self.version, "load_failures": self.load_failures,
                "refused_older": self.refused_older, "last_load_error": self.last_load_error}

    def load(self, version: int | None, wait_s: float = 0.0) -> dict[str, Any]:
        """Fetch ``version`` (None = newest) from the store and apply it in place.

        A version older than the one served is refused (:class:`ControlRefused`, 409). A version
        not committed in the store is refused (404) after waiting up to ``wait_s`` for it to commit
        (the broadcast placement publishes a version after sending it). A version that cannot be
        fetched and verified leaves the served one in place: the answer says so (``applied: false``,
        ``requested``, ``error``) instead of raising."""
        if version is not None and wait_s > 0:
            self._wait_committed(version, wait_s)
        with self._lock:
            started = time.perf_counter()
            current = self.version
            have_version = current if self._tensors is not None else None
            if version is not None and version < current:
                self._refuse_older(version, current)
            if version is not None and version not in self.reader.versions():
                raise ControlRefused(f"weight version {version} is not committed in this run's store", 404)
            target = version if version is not None else self.reader.latest()
            if target is None:
                raise LookupError("no weight version has been published yet")
            if target < current:  # the store's newest is behind what is served (versions deleted)
                self._refuse_older(target, current)
            if target == current and current:
                return {"version": target, "seconds": 0.0, "applied": False}
            # The held tensors are this worker's own (the engine copies them into its model), so
            # the delta is applied to them in place: no model-sized allocation and copy per sync
            # (~0.2 s of page faults and memcpy for 135M bf16 params on a 2-core VM, more than the
            # delta itself). A failed fetch may leave them half-patched: drop them, so the next
            # load replays from a keyframe.
            try:
                got = self._apply(target, have_version)
            except DeltaloopError as exc:  # corrupt, missing, unreachable: keep serving what we have
                self._tensors = None
                self.load_failures += 1
                self.last_load_error = str(exc)
                log.warning("rollout worker: cannot apply weight version %d, still serving version %d: %s",
                            target, current, exc)
                return {"version": current, "requested": target, "applied": False, "error": str(exc),
                        "retryable": exc.retryable, "seconds": time.perf_counter() - started}
            except BaseException:
                self._tensors = None
                raise
            return {"version": got, "seconds": time.perf_counter() - started, "applied": True}

    def _wait_committed(self, version: int, wait_s: float) -> None:
        """Return once ``version`` is committed in the store (its manifest exists: one HEAD a poll, not
        a listing of the run's weights), or after ``wait_s`` seconds."""
        from infra.weightsync.layout import manifest_key

        key, deadline = manifest_key(self.reader.prefix, version), time.monotonic() + wait_s
        while not self.store.exists(key) and time.monotonic() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _apply(self, target: int, have_version: int | None) -> int:
        """Fetch ``target`` and hand it to the engine; the version now served."""
        if self.remote_weights:  # fetched and verified inside the engine's own process
            return int(self.engine.apply_version(target)["version"])
        tensors, got = self.reader.fetch(target=target, have=self._tensors, have_version=have_version, inplace=True)
        self.engine.load_weights(tensors, got)
        self._tensors = tensors
        return got

    def digests(self) -> dict[str, Any]:
        """Per-tensor digests of the weights the engine serves (:mod:`infra.rollout.digest`), with
        the version: equal to the published tensors' digests when the engine serves them exactly."""
        with self._lock:
            if self.remote_weights:
                return {"version": self.version, "tensors": self.engine.served_digests()["tensors"]}
            from infra.model import publishable_state
            from infra.rollout.digest import state_digests

            return {"version": self.version, "tensors": state_digests(publishable_state(self.engine.model))}

    def _refuse_older(self, version: int, current: int) -> None:
        """Count and refuse a load that would move the served policy backwards."""
        self.refused_older += 1
        log.warning("rollout worker: load of weight version %d refused: it serves version %d", version, current)
        raise ControlRefused(f"weight version {version} is older than version {current}, which this worker "
                             "serves: refused (a rollout worker never moves to an older version)", 409)

    def rollout(self, prompts_key: str, out_key: str, n: int, temperature: float,
                max_new_tokens: int, seed: int) -> dict[str, Any]:
        """Generate ``n`` samples per prompt of the batch at ``prompts_key``; write ``out_key``.

        Both keys must lie in this run's rollout areas (:func:`infra.rollout.guard.check_rollout_key`)."""
        from infra.rollout.engine import SamplingParams

        from infra.model import render_prompts

        check_rollout_key(self.run_id, prompts_key, "prompts_key")
        check_rollout_key(self.run_id, out_key, "out_key")
        try:
            batch = get_json(self.store, prompts_key)
        except ObjectNotFound as exc:
            raise ControlRefused(f"prompts_key {prompts_key!r} does not exist", 404) from exc
        except ValueError as exc:
            raise BadRequest(f"prompts_key {prompts_key!r} is not JSON: {exc}") from exc
        prompts, render, stop = prompt_batch(batch, prompts_key)
        prompt_ids = render_prompts(self.tokenizer, prompts, render["chat"], render.get("system_prompt"))
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=self.cfg.rollout.top_p, stop=stop, seed=seed)
        with self._lock:
            version = self.version
            started = time.perf_counter()
            completions = self.engine.generate_ids(prompt_ids, n, params)
            seconds = time.perf_counter() - started
        return write_rollouts(self.store, out_key, version=version, n=n, prompts=prompts, prompt_ids=prompt_ids,
                              samples=sample_records(completions, version), seconds=seconds)


class LoadReq(BaseModel):
    """Body of ``POST /v1/load``: the version to serve (None = newest), and how long to wait for it
    to be committed in the store (seconds; 0 = refuse it at once if it is not)."""

    model_config = ConfigDict(extra="forbid")

    version: int | None = Field(None, ge=1)
    wait_s: float = Field(0.0, ge=0.0, le=3600.0)


class BroadcastJoinReq(BaseModel):
    """Body of ``POST /v1/broadcast/join``: the group's address (from trainer rank 0) and this worker's rank."""

    model_config = ConfigDict(extra="forbid")

    address: dict[str, Any]
    rank: int = Field(1, ge=1, le=65535)


class BroadcastLoadReq(BaseModel):
    """Body of ``POST /v1/broadcast/load``: the version trainer rank 0 sends now."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(..., ge=1)


class RolloutReq(BaseModel):
    """Body of ``POST /v1/rollout``: where the prompts are, where to write, how to sample."""

    model_config = ConfigDict(extra="forbid")

    prompts_key: str
    out_key: str
    n: int = Field(1, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    max_new_tokens: int = Field(32, ge=1, le=32768)
    seed: int = 0


WORKER_PATHS = frozenset({"/health", "/v1/version", "/v1/load", "/v1/rollout", "/v1/weights/digest",
                          "/v1/broadcast/join", "/v1/broadcast/load"})


def build_app(worker: RolloutWorker, token: str, model_name: str = "policy", base: Any = None) -> Any:
    """The FastAPI application serving ``worker`` (worker endpoints plus the OpenAI API); the
    control endpoints require ``Authorization: Bearer <token>``.

    ``base``: an application that already serves the OpenAI API (vLLM's own server, for
    ``rollout.type: vllm``); requests for the worker endpoints go to ours (its ``/health`` is
    shadowed), everything else (its lifespan included) to ``base``, and the same guards wrap both,
    so every non-``GET`` path of it outside the OpenAI API needs the token too."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse

    from infra.rollout.guard import BodyLimit, ControlAuth, error_body
    from infra.rollout.openai_api import OPENAI_PATHS, ApiLimits, OpenAIFrontend, add_routes

    limits = ApiLimits.of(worker.cfg.rollout)
    app = FastAPI(title="deltaloop rollout worker")
    if base is None:
        app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
        app.add_middleware(ControlAuth, token=token, open_paths=OPENAI_PATHS)  # outermost: before the body is read
        add_routes(app, OpenAIFrontend(worker.engine, model_name, limits=limits))

    @app.exception_handler(ControlRefused)
    def _refused(_: Request, exc: ControlRefused) -> JSONResponse:
        kind = {404: "not_found", 409: "conflict"}.get(exc.status, "forbidden")
        return JSONResponse(error_body(exc.status, str(exc), kind), status_code=exc.status)

    @app.exception_handler(BadRequest)
    def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc), "invalid_request_error"), status_code=400)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, **worker.status()}

    @app.get("/v1/version")
    def version() -> dict[str, Any]:
        return {"version": worker.version}

    @app.post("/v1/load")
    def load(req: LoadReq) -> dict[str, Any]:
        try:
            return worker.load(req.version, req.wait_s)
        except LookupError as exc:
            raise HTTPException(409, str(exc)) from exc

    @app.post("/v1/broadcast/join")
    def broadcast_join(req: BroadcastJoinReq) -> dict[str, Any]:
        return worker.broadcast.join(req.address, req.rank)

    @app.post("/v1/broadcast/load")
    def broadcast_load(req: BroadcastLoadReq) -> dict[str, Any]:
        return worker.broadcast.load(req.version)

    @app.post("/v1/rollout")
    def rollout(req: RolloutReq) -> dict[str, Any]:
        return worker.rollout(req.prompts_key, req.out_key, req.n, req.temperature, req.max_new_tokens, req.seed)

    @app.post("/v1/weights/digest")
    def digest() -> dict[str, Any]:  # POST: it costs a pass over the model, so it takes the token
        return worker.digests()

    if base is None:
        return app
    split = _Split(app, base, WORKER_PATHS)
    return ControlAuth(BodyLimit(split, max_bytes=limits.max_body_bytes), token=token, open_paths=OPENAI_PATHS)


class _Split:
    """ASGI: HTTP requests for ``paths`` go to ``ours``, everything else to ``base``."""

    def __init__(self, ours: Any, base: Any, paths: frozenset[str]) -> None:
        self.ours, self.base, self.paths = ours, base, paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        target = self.ours if scope["type"] == "http" and scope["path"] in self.paths else self.base
        await target(scope, receive, send)


def main() -> None:
    """Process entry point: bind, report the address, load the model, serve."""
    import uvicorn

    from infra.proc import bind_socket

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", help="RolloutSpec JSON file (default: $DELTALOOP_SPEC).")
    args = parser.parse_args()
    spec = RolloutSpec.read(args.spec)
    exit_with_parent()
    from infra.rollout.guard import worker_token

    token = worker_token()  # from $DELTALOOP_ROLLOUT_TOKEN; no token, no worker
    sock = bind_socket(spec.bind, spec.port)
    if spec.config.rollout.type == "vllm":
        asyncio.run(_serve_vllm(spec, token, sock))
        return
    worker = RolloutWorker(spec)
    config = uvicorn.Config(build_app(worker, token, spec.model_name), log_level="warning")
    _announce(worker, spec, sock)
    uvicorn.Server(config).run(sockets=[sock])


def _announce(worker: RolloutWorker, spec: RolloutSpec, sock: Any) -> None:
    """Publish the worker's address once its model is loaded (it answers ``/health`` moments later)."""
    from infra.gcpause import freeze_startup_objects
    from infra.rpc import host_address, publish_address

    freeze_startup_objects()  # later full GCs skip torch's ~170k import-time objects (~110 ms each)
    host = spec.bind if spec.bind in ("127.0.0.1", "localhost", "::1") else host_address()
    publish_address(worker.store, spec.address_key, host, sock.getsockname()[1])


async def _serve_vllm(spec: RolloutSpec, token: str, sock: Any) -> None:
    """The worker with vLLM: the engine on this event loop, vLLM's OpenAI server as the base app."""
    import uvicorn

    from infra.rollout.vllm_engine import openai_app, start_engine

    loop = asyncio.get_running_loop()
    engines: list[Any] = []

    def factory(rollout_cfg: Any, model: Any, tokenizer: Any) -> Any:  # runs in a thread: waits on the loop
        engine = asyncio.run_coroutine_threadsafe(
            start_engine(model, tokenizer, rollout_cfg, spec.config.seed, spec.model_name), loop).result()
        engines.append(engine)
        return engine

    try:
        worker = await asyncio.to_thread(RolloutWorker, spec, factory)
        app = build_app(worker, token, spec.model_name, base=await openai_app(worker.engine))
        _announce(worker, spec, sock)
        await uvicorn.Server(uvicorn.Config(app, log_level="warning")).serve(sockets=[sock])
    finally:
        for engine in engines:
            await engine.aclose()


if __name__ == "__main__":
    main()
