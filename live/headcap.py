"""uvicorn's HTTP protocol for ``qlab serve``: httptools, with the request head capped.

httptools (llhttp) keeps a header it has not finished reading in memory, so
one client sending an endless header grows the server without bound (200 MB
of ``X-Pad: aaa...`` cost a stock uvicorn server 330 MB). h11 has a cap
(uvicorn's ``h11_max_incomplete_event_size``) but costs about 0.3 ms more per
refusal. :class:`HeadCappedHttpTools` keeps httptools' speed and adds a cap
on memory: it counts the bytes that arrive while a request's head is
incomplete, and when the head is still incomplete after more than
:data:`HEAD_CAP_BYTES` have arrived, it answers 431 in the service's error
envelope and closes the connection. (The count is checked after each read, so
a head that ends within the read that passes the cap is let through: the
parser then holds at most one read, up to 256 KiB, past the cap.)

It builds on uvicorn's ``HttpToolsProtocol`` through asyncio's
``data_received`` and httptools' ``on_headers_complete`` and
``on_message_complete`` callbacks; tests/test_fuzz.py sends an unfinished
66 KiB head and an endless header to a real server with each parser.
"""

from __future__ import annotations

from http import HTTPStatus

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .envelope import error_response

#: The largest request head (request line and headers) either parser accepts.
HEAD_CAP_BYTES = 64 * 1024


class HeadCappedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering 431 to a request head past HEAD_CAP_BYTES."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # a new connection's first bytes are a head
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            # Counted whole: a read that also holds the end of the head resets the count below, in the parser's
            # callback, so a small head followed by a large body in one read is not mistaken for a large head.
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > HEAD_CAP_BYTES and not self.transport.is_closing():
            self._refuse_head()

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # what comes next on this connection starts a new head

    def _refuse_head(self) -> None:
        response = error_response(431, "invalid_request", "headers_too_large",
                                  f"the request head passes the limit of {HEAD_CAP_BYTES} bytes")
        status = HTTPStatus(response.status_code)
        head = [f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()]
        head += [name + b": " + value + b"\r\n" for name, value in response.raw_headers]
        self.transport.write(b"".join(head) + b"connection: close\r\n\r\n" + response.body)
        self.transport.close()


def http_options(http: str) -> dict:
    """uvicorn.Config's arguments for ``--http``: httptools (the default, capped here) or h11 (capped by h11).

    h11 answers a head past the cap with a plain-text 400, as uvicorn does for any
    request h11 cannot parse; the capped httptools answers 431 in the envelope.
    """
    if http == "h11":
        return {"http": "h11", "h11_max_incomplete_event_size": HEAD_CAP_BYTES}
    return {"http": HeadCappedHttpTools}
