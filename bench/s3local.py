"""A local S3-protocol server (moto) on a loopback port, for benchmarks.

The server binds port 0 itself and prints the address it got (werkzeug's ``Running on`` line,
gunicorn's ``Listening at``); that line in its log is the readiness probe, so no port is chosen
here and bound there.

``keep_alive=True`` serves moto's application with gunicorn (one process, so one in-memory store;
threads) instead of moto's own werkzeug server, which closes the connection after every response:
across a link with a round-trip time that costs every request a new TCP handshake, which a real
object store (persistent HTTP/1.1 connections) does not.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from infra.proc import LOOPBACK, ServiceSpec, spawn, tail

_RUNNING = re.compile(r"(?:Running on|Listening at:) http://[^:\s]+:(\d+)")


def _port_probe(log: str) -> Callable[[], int | None]:
    def probe() -> int | None:
        found = _RUNNING.search(tail(log, lines=50))
        return int(found.group(1)) if found else None

    return probe


def _spec(host: str, log: str, keep_alive: bool) -> ServiceSpec:
    if not keep_alive:
        return ServiceSpec.python("moto server", "moto.server", ["-H", host, "-p", "0"], log=log)
    return ServiceSpec.python("moto server (gunicorn)", "gunicorn", [
        "--bind", f"{host}:0", "--workers", "1", "--worker-class", "gthread", "--threads", "16",
        "--keep-alive", "600", "--timeout", "600", "--log-level", "info", "bench.s3local:moto_app()"], log=log)


def moto_app() -> object:
    """moto's WSGI application (what ``python -m moto.server`` serves)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    return DomainDispatcherApplication(create_backend_app)


@contextmanager
def moto_server(timeout_s: float = 60.0, *, netns: str | None = None,
                keep_alive: bool = False) -> Iterator[tuple[str, int]]:
    """Start a moto S3 server on a free loopback port; yields (host, port); stops it after.

    ``netns``: run it inside that network namespace instead, on all its addresses (yields
    ``("0.0.0.0", port)``: the caller knows the namespace's addresses). ``keep_alive``: see the
    module docstring."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    with tempfile.TemporaryDirectory(prefix="moto-") as tmp:
        log = str(Path(tmp) / "moto.log")
        host = LOOPBACK if netns is None else "0.0.0.0"
        spec = _spec(host, log, keep_alive)
        if netns is not None:
            spec = dataclasses.replace(spec, argv=["ip", "netns", "exec", netns, *spec.argv])
        server = spawn(spec)
        try:
            port = server.wait_ready(_port_probe(log), timeout_s)
            yield host, port
        finally:
            server.terminate()
