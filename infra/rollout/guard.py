"""What the rollout worker checks before it does anything for a caller.

- :class:`BodyLimit`: an ASGI middleware that reads at most ``max_bytes`` of a request body (413 in
  OpenAI's error shape above it, whether the size is announced by ``Content-Length`` or not), so a
  client cannot make the worker buffer or parse an unbounded body.
- :class:`ControlAuth`, :func:`control_token`, :func:`check_bearer`: the control endpoints
  (``/v1/load``, ``/v1/rollout``) move the worker to other weights and make it read and write the
  object store, so they take ``Authorization: Bearer <token>``, the run's ``"rollout-control"`` key
  (:func:`infra.secrets.derive_key`) in hex, compared in constant time: 401 without it, 403 with a
  wrong one, before the body is read. Every non-``GET`` endpoint outside the OpenAI API is guarded
  (default deny); the OpenAI endpoints stay open (they only sample from the served policy).
- :func:`check_rollout_key`: the store keys ``/v1/rollout`` reads and writes must lie in this run's
  rollout areas, ``runs/<run>/step-<N>/`` and ``runs/<run>/eval/`` (where the pipeline puts prompt
  batches and completions), be plain relative keys and end in ``.json``: a holder of the token
  cannot make the worker read other runs' artefacts or overwrite weights, checkpoints or control
  records (403 otherwise).
"""

from __future__ import annotations

import hmac
import json
import os
import re
from typing import Any, Awaitable, Callable

from infra.rollout.errors import ControlRefused, RolloutError
from infra.secrets import derive_key

CONTROL_PURPOSE = "rollout-control"
_STEP = re.compile(r"step-\d{1,12}")
MAX_KEY_CHARS = 1024

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


TOKEN_ENV = "DELTALOOP_ROLLOUT_TOKEN"


def control_token(secret: bytes) -> str:
    """The bearer token of the worker's control endpoints for a run with ``secret``."""
    return derive_key(secret, CONTROL_PURPOSE).hex()


def token_env(secret: bytes) -> dict[str, str]:
    """The environment entry that hands the worker its token: only the token, never the run secret.

    The worker parses untrusted HTTP; holding the run secret would let a compromised worker derive
    the trainer's RPC key and the checkpoint MAC key. With only its own token it can drive itself.
    """
    return {TOKEN_ENV: control_token(secret)}


def worker_token() -> str:
    """The token the worker checks, from :data:`TOKEN_ENV` (raises :class:`RolloutError` when it is
    missing or malformed: no token, no worker)."""
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) != 64 or any(c not in "0123456789abcdef" for c in token):
        raise RolloutError(f"the rollout worker needs its control token in ${TOKEN_ENV} (64 hex digits)")
    return token


def check_bearer(header: str | None, token: str) -> None:
    """Raise :class:`ControlRefused` (401: no bearer token, 403: a wrong one) unless ``header`` is
    ``Bearer <token>``."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise ControlRefused("control endpoint: missing 'Authorization: Bearer <token>' (the run's "
                             "rollout-control token)", 401)
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ControlRefused("control endpoint: wrong bearer token for this run", 403)


def check_rollout_key(run_id: str, key: object, field: str) -> str:
    """``key`` if it is a plain key in one of ``run_id``'s rollout areas (see the module docstring);
    else :class:`ControlRefused` (403) naming ``field`` and the rule."""
    areas = f"runs/{run_id}/step-<N>/ or runs/{run_id}/eval/"
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_CHARS:
        raise ControlRefused(f"{field}: a store key of 1 to {MAX_KEY_CHARS} characters is required", 403)
    parts = key.split("/")
    plain = all(p not in ("", ".", "..") for p in parts) and not any(c in key for c in "\\\0")
    inside = (len(parts) >= 4 and parts[:2] == ["runs", run_id]
              and (_STEP.fullmatch(parts[2]) is not None or parts[2] == "eval"))
    if not (plain and inside and key.endswith(".json")):
        raise ControlRefused(f"{field} {key[:200]!r} is outside this run's rollout areas ({areas}, "
                             "a plain key ending in .json)", 403)
    return key


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error document (the one error shape of the worker and the champion endpoint)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_json(send: Send, status: int, body: Any, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer an ASGI request with ``status`` and ``body`` as JSON (for middleware that answers itself)."""
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def send_error(send: Send, status: int, message: str, code: str,
                     extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer ``status`` with OpenAI's error document (the worker's one error shape)."""
    await send_json(send, status, error_body(status, message, code), extra_headers)


class ControlAuth:
    """ASGI middleware: every request except ``GET``/``HEAD`` and the ``open_paths`` (the OpenAI API)
    needs the bearer ``token`` (:func:`check_bearer`), checked before its body is read. Default
    deny: a state-changing endpoint added later is guarded without being listed."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], token: str,
                 open_paths: tuple[str, ...]) -> None:
        self.app, self.token, self.open_paths = app, token, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD") and scope["path"] not in self.open_paths:
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            try:
                check_bearer(header.decode("latin-1"), self.token)
            except ControlRefused as exc:
                extra = [(b"www-authenticate", b"Bearer")] if exc.status == 401 else []
                await send_error(send, exc.status, str(exc), "unauthorized" if exc.status == 401 else "forbidden",
                                  extra)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: request bodies over ``max_bytes`` are answered 413 and never passed on."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = dict(scope.get("headers") or []).get(b"content-length")
        if announced is not None and (not announced.isdigit() or int(announced) > self.max_bytes):
            await self._refuse(send)
            return
        body, more = bytearray(), True
        while more:  # read it all here (it is bounded), then hand it on in one piece
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away
                return
            body += msg.get("body", b"")
            more = bool(msg.get("more_body", False))
            if len(body) > self.max_bytes:
                await self._refuse(send)
                return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        await send_error(send, 413, f"request body exceeds this server's limit of {self.max_bytes} bytes",
                          "request_too_large", [(b"connection", b"close")])
