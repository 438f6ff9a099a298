"""A local S3-protocol server (moto) on a loopback port, for benchmarks.

The server binds port 0 itself and prints the address it got (werkzeug's ``Running on`` line);
that line in its log is the readiness probe, so no port is chosen here and bound there.
"""

from __future__ import annotations

import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from infra.proc import LOOPBACK, ServiceSpec, spawn, tail

_RUNNING = re.compile(r"Running on http://[^:\s]+:(\d+)")


def _port_probe(log: str) -> Callable[[], int | None]:
    def probe() -> int | None:
        found = _RUNNING.search(tail(log, lines=50))
        return int(found.group(1)) if found else None

    return probe


@contextmanager
def moto_server(timeout_s: float = 60.0) -> Iterator[tuple[str, int]]:
    """Start ``python -m moto.server`` on a free loopback port; yields (host, port); stops it after."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
    with tempfile.TemporaryDirectory(prefix="moto-") as tmp:
        log = str(Path(tmp) / "moto.log")
        server = spawn(ServiceSpec.python("moto server", "moto.server", ["-H", LOOPBACK, "-p", "0"], log=log))
        try:
            port = server.wait_ready(_port_probe(log), timeout_s)
            yield LOOPBACK, port
        finally:
            server.terminate()
