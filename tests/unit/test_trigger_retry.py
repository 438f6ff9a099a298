"""``infra.ops.trigger.request`` against a real loopback HTTP server that answers like a busy Prefect
server on SQLite: transient 503/429 answers are retried (``Retry-After`` honoured), a client error is
raised at once, and a server that stays busy surfaces its last answer instead of looping forever."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import httpx
import pytest

from infra.ops.trigger import request


class Script:
    """The status codes the server answers, in order; the last one repeats."""

    def __init__(self) -> None:
        self.codes: list[int] = [200]
        self.seen: list[tuple[str, str, bytes]] = []


@pytest.fixture()
def server() -> Iterator[tuple[str, Script]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            script.seen.append((self.command, self.path, body))
            code = script.codes.pop(0) if len(script.codes) > 1 else script.codes[0]
            payload = json.dumps({"n": len(script.seen)}).encode()
            self.send_response(code)
            if code == 429:
                self.send_header("Retry-After", "0")
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", script
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_transient_answers_are_retried_with_the_same_body(server: tuple[str, Script]) -> None:
    url, script = server
    script.codes = [503, 429, 502, 200]
    with httpx.Client(base_url=url, trust_env=False) as c:
        r = request(c, "POST", "deployments/x/create_flow_run", json={"idempotency_key": "k1"}, backoff=0.01)
    assert r.status_code == 200 and r.json() == {"n": 4}
    assert [s[0] for s in script.seen] == ["POST"] * 4
    assert {json.loads(s[2])["idempotency_key"] for s in script.seen} == {"k1"}


def test_client_errors_are_not_retried(server: tuple[str, Script]) -> None:
    url, script = server
    script.codes = [404, 200]
    with httpx.Client(base_url=url, trust_env=False) as c, pytest.raises(httpx.HTTPStatusError) as err:
        request(c, "GET", "deployments/name/nope/nope", backoff=0.01)
    assert err.value.response.status_code == 404 and len(script.seen) == 1


def test_a_server_that_stays_busy_raises_after_the_attempts(server: tuple[str, Script]) -> None:
    url, script = server
    script.codes = [503]
    with httpx.Client(base_url=url, trust_env=False) as c, pytest.raises(httpx.HTTPStatusError) as err:
        request(c, "GET", "flow_runs/1", attempts=3, backoff=0.01)
    assert err.value.response.status_code == 503 and len(script.seen) == 3


def test_a_refused_connection_is_retried_then_raised() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/", trust_env=False) as c, pytest.raises(httpx.ConnectError):
        request(c, "GET", "health", attempts=2, backoff=0.01)
