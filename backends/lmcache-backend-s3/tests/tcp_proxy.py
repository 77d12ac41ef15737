"""A TCP proxy on 127.0.0.1 that forwards to a server or drops every connection.

``drop()`` closes the connections in flight with a reset and resets each new one at
once; ``forward()`` passes traffic again. Runs in daemon threads; ``close()`` stops it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class DroppingProxy:
    """Forward 127.0.0.1:<port> to ``upstream`` unless dropping."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.dropping = False
        self.dropped = 0
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drop(self) -> None:
        """Reset every open connection and every new one."""
        self.dropping = True
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            _reset(s)

    def forward(self) -> None:
        self.dropping = False

    def close(self) -> None:
        self._closed = True
        self.drop()
        with contextlib.suppress(OSError):
            self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.dropping:
                self.dropped += 1
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data or self.dropping:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _reset(s) if self.dropping else _close(s)
                with self._lock:
                    self._socks.discard(s)


def _reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _close(s)


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
