"""A loopback TCP forwarder for fault tests: put it between a client and a real server to take the
link down (:meth:`Forwarder.close` drops the listener and every open connection, so the port refuses
connections as a restarting server does) or to cut responses mid-body (``cut_after``/``cuts``)."""

from __future__ import annotations

import socket
import threading


class Forwarder:
    """Forward ``127.0.0.1:port`` (0: any free port, see :attr:`url`) to ``target``.

    The first ``cuts`` responses that pass more than ``cut_after`` bytes are cut there and their
    connection dropped: a body lost mid-way. ``connections`` counts accepted clients, ``cut`` the
    responses cut so far."""

    def __init__(self, target: tuple[str, int], port: int = 0, cut_after: int = 0, cuts: int = 0) -> None:
        self.target, self.cut_after, self.cuts_left = target, cut_after, cuts
        self.cut = self.connections = 0
        self.srv = socket.create_server(("127.0.0.1", port))
        self.socks: list[socket.socket] = [self.srv]
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.srv.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            self.connections += 1
            self.socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _take_cut(self) -> bool:
        with self._lock:
            if self.cuts_left <= 0:
                return False
            self.cuts_left -= 1
            self.cut += 1
            return True

    def _pipe(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        passed = 0
        try:
            while data := src.recv(65536):
                if response and passed + len(data) > self.cut_after and self._take_cut():
                    dst.sendall(data[: self.cut_after - passed])
                    break
                dst.sendall(data)
                passed += len(data)
        except OSError:
            pass
        _drop(src, dst)

    def close(self) -> None:
        """Stop listening and drop every connection."""
        _drop(*self.socks)


def _drop(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
