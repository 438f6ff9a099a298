"""A restartable S3-protocol server for the chaos bench: moto behind a write-ahead journal.

moto keeps its buckets in memory, so a moto server killed with SIGKILL and started again would come
back empty — a data loss no real object store has, which would turn "the S3 server restarted" into
"every artefact vanished". This server keeps moto's S3 protocol and adds what a durable store
promises: a write is acknowledged only once it survives the server. Every mutating request
(PUT, POST, DELETE) that moto answers with 2xx is appended to a journal file and fsynced *before*
the answer goes back to the client; a (re)started server replays the journal into a fresh moto
before it binds its port. A kill -9 at any moment therefore loses exactly the writes whose answer
the client never got — which the client must retry anyway.

Run as ``python -m bench.chaos_s3 --journal PATH --port P`` (``P`` 0 picks a free port; the
``Running on http://HOST:PORT`` line in the log says which). :class:`DurableS3` starts it, restarts
it on the same port (the endpoint every run process was configured with) and stops it.

Not supported: multipart uploads across a restart (a replayed part names an upload id the new
server never issued; replay errors are counted in the log as ``replay errors: N``). The store's
multipart threshold is 64 MiB, above any object of the demo-sized runs the bench drives.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from infra.lifeline import exit_with_parent
from infra.proc import LOOPBACK, ServiceProcess, ServiceSpec, spawn, tail

_RUNNING = re.compile(r"Running on http://[^:\s]+:(\d+)")
_MUTATING = ("PUT", "POST", "DELETE")
_KEEP = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "CONTENT_TYPE", "CONTENT_LENGTH", "SERVER_NAME",
         "SERVER_PORT", "SERVER_PROTOCOL", "wsgi.url_scheme")


class Journal:
    """WSGI middleware: forwards every request to ``app``; journals acknowledged mutations (fsync)."""

    def __init__(self, app: Callable[..., Iterable[bytes]], path: Path) -> None:
        self.app = app
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "ab")

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in _MUTATING:
            return self.app(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = io.BytesIO(body)
        answer: dict[str, Any] = {}

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], Any]:
            answer["status"], answer["headers"] = status, headers
            return lambda _data: None

        chunks = b"".join(self.app(environ, capture))
        if answer["status"][:1] == "2":
            self._append(environ, body)
        start_response(answer["status"], answer["headers"])
        return [chunks]

    def _append(self, environ: dict[str, Any], body: bytes) -> None:
        meta = {k: environ[k] for k in _KEEP if k in environ}
        meta["headers"] = {k: v for k, v in environ.items() if k.startswith("HTTP_")}
        meta["body_bytes"] = len(body)
        line = json.dumps(meta).encode() + b"\n"
        with self._lock:
            self._file.write(line + body)
            self._file.flush()
            os.fsync(self._file.fileno())


def replay(app: Callable[..., Iterable[bytes]], path: Path) -> tuple[int, int]:
    """Apply every journaled request of ``path`` to ``app`` in order; returns (requests, errors).

    A record cut short by a kill during its append (never acknowledged) ends the replay."""
    done = errors = 0
    if not path.exists():
        return done, errors
    with open(path, "rb") as f:
        while True:
            line = f.readline()
            if not line.endswith(b"\n"):
                break
            meta = json.loads(line)
            want = meta.pop("body_bytes")
            body = f.read(want)
            if len(body) < want:
                break
            environ = {**{k: v for k, v in meta.items() if k != "headers"}, **meta["headers"],
                       "wsgi.input": io.BytesIO(body), "wsgi.errors": io.StringIO(), "wsgi.version": (1, 0),
                       "wsgi.multithread": False, "wsgi.multiprocess": False, "wsgi.run_once": False,
                       "SCRIPT_NAME": "", "REMOTE_ADDR": LOOPBACK}
            status: list[str] = []
            b"".join(app(environ, lambda s, h, e=None: status.append(s) or (lambda _d: None)))
            done += 1
            errors += 0 if status and status[0][:1] == "2" else 1
    return done, errors


def main(argv: list[str] | None = None) -> None:
    """Replay the journal into a fresh moto, then serve it (journaling) on ``--host:--port``."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--journal", required=True, type=Path)
    parser.add_argument("--host", default=LOOPBACK)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    exit_with_parent()  # the harness that started it owns it
    app = DomainDispatcherApplication(create_backend_app)
    t0 = time.perf_counter()
    done, errors = replay(app, args.journal)
    print(f"replayed {done} requests in {time.perf_counter() - t0:.2f}s; replay errors: {errors}", flush=True)
    run_simple(args.host, args.port, Journal(app, args.journal), threaded=True, request_handler=MotoRequestHandler)


class DurableS3:
    """The journaled moto server as a service: :meth:`start`, :meth:`restart` (kill -9, then start on
    the same port), :meth:`stop`. ``endpoint`` is valid after :meth:`start`."""

    def __init__(self, folder: Path, timeout_s: float = 120.0) -> None:
        self.folder = Path(folder)
        self.timeout_s = timeout_s
        self.journal = self.folder / "s3.journal"
        self.port = 0
        self.starts = 0
        self._proc: ServiceProcess | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._proc.proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the server (on :attr:`port`, or a free one the first time) and wait until it serves."""
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
        self.starts += 1
        log = str(self.folder / f"s3-{self.starts}.log")
        spec = ServiceSpec.python("s3 server", "bench.chaos_s3",
                                  ["--journal", str(self.journal), "--port", str(self.port)], log=log)
        self._proc = spawn(spec)

        def probe() -> int | None:
            found = _RUNNING.search(tail(log, lines=50))
            return int(found.group(1)) if found else None

        self.port = self._proc.wait_ready(probe, self.timeout_s)

    def kill(self) -> None:
        """SIGKILL the server's process group (no shutdown of any kind)."""
        if self._proc is not None:
            os.killpg(self._proc.proc.pid, 9)
            self._proc.proc.wait()
            self._proc = None

    def restart(self, down_s: float = 1.0) -> float:
        """kill -9, stay down ``down_s`` seconds, start again on the same port; returns seconds down."""
        t0 = time.perf_counter()
        self.kill()
        time.sleep(down_s)
        self.start()
        return time.perf_counter() - t0

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name`` (journaled like every other write)."""
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=name)

    def stop(self) -> None:
        """Stop the server (TERM, then KILL of its tree)."""
        if self._proc is not None:
            self._proc.terminate()
            self._proc = None


class JournalTail:
    """Follows the journal as the server appends to it: every acknowledged write, in order, at no cost
    to the server (the bench learns a run's progress from it instead of polling the store)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def poll(self) -> list[tuple[str, str]]:
        """``(method, path)`` of every complete record appended since the last call."""
        out: list[tuple[str, str]] = []
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return out
        if size <= self.offset:
            return out
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            while True:
                line = f.readline()
                if not line.endswith(b"\n"):
                    break
                meta = json.loads(line)
                if f.tell() + meta["body_bytes"] > size:
                    break  # body still being written
                f.seek(meta["body_bytes"], os.SEEK_CUR)
                self.offset = f.tell()
                out.append((meta["REQUEST_METHOD"], meta.get("PATH_INFO", "")))
        return out


if __name__ == "__main__":
    main()
