"""A scripted HTTP server on a raw socket, for tests that must control every byte an upstream sends.

Each connection carries one request; ``handle(conn)`` reads it (:func:`read_request`) and answers on
the socket, in a thread of its own, so a test can hold an answer back, break a stream off or hang
up.
"""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


def read_request(conn: socket.socket) -> tuple[str, dict[str, str], bytes]:
    """The request line, the headers (names lower-cased) and the whole body of one request."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    while len(body) < int(headers.get("content-length", 0)):
        body += conn.recv(65536)
    return lines[0], headers, body


@contextmanager
def listening(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A server on a free loopback port that gives each connection to ``handle``; yields its URL."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve(conn: socket.socket) -> None:
        with conn:
            handle(conn)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
