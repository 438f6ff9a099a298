"""A bandwidth-limited TCP proxy (loopback) for benchmarks: a "WAN link" in front of a local server.

All connections share one token bucket per direction, like a real link of ``rate`` bytes/s each
way: parallel streams do not get more bandwidth than one. Small bursts (``burst`` bytes) pass at
once, as on a real link with buffers. Threads, not asyncio, so it runs beside any code.
"""

from __future__ import annotations

import socket
import threading
import time


class TokenBucket:
    """Thread-safe token bucket: ``take(n)`` blocks until n bytes may pass."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = float(rate), burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        """Block until ``n`` bytes may pass, then spend them."""
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
            time.sleep(min(wait, 0.05))


class ThrottleProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` at most ``rate`` bytes/s per direction."""

    def __init__(self, target: tuple[str, int], rate: float = 50e6, burst: int = 256 << 10,
                 chunk: int = 64 << 10) -> None:
        self.target, self.chunk = target, chunk
        self.up, self.down = TokenBucket(rate, burst), TokenBucket(rate, burst)
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="throttle-accept", daemon=True)

    @property
    def url(self) -> str:
        """The proxy's endpoint (what a client connects to instead of the server)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ThrottleProxy":
        """Start accepting connections; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting connections (open ones end with their peers)."""
        self._stop.set()
        try:
            self._srv.close()
        except OSError:
            pass

    def __enter__(self) -> "ThrottleProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pipe, args=(client, upstream, self.up), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.down), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, bucket: TokenBucket) -> None:
        try:
            while True:
                data = src.recv(self.chunk)
                if not data:
                    break
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
