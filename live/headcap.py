"""uvicorn's HTTP protocols for ``qlab serve``: the request head capped, and heads and bodies read
in time.

The head cap. httptools (llhttp) keeps a header it has not finished reading in memory, so
one client sending an endless header grows the server without bound (200 MB of
``X-Pad: aaa...`` cost a stock uvicorn server 330 MB). h11 has a cap (uvicorn's
``h11_max_incomplete_event_size``) but costs about 0.3 ms more per refusal.
:class:`HeadCappedHttpTools` keeps httptools' speed and caps both what an unfinished head
holds in memory and what a finished one may be: it counts the bytes that arrive while a
request's head is incomplete, and when the head is still incomplete after more than
:data:`HEAD_CAP_BYTES` have arrived it answers 431 in the service's error envelope and
closes the connection; and once a head is complete it measures it (its request target and
headers, as the parser handed them over), so a head past the cap that came in one read (a
100 KB header sent at once) is refused the same way, before the application sees it.

Reading in time. A client that sends its head, or its body, slowly holds a connection (and
with it a file descriptor and the parser's buffer) as long as it likes unless the server
stops waiting: :class:`ReadDeadlines` gives a request head ``qlab serve --header-timeout``
seconds (10) from the connection's opening, or from the first byte of a head on a kept-alive
connection, and its body ``--body-timeout`` seconds (30) from the end of its head. Past either, the
server answers 408 ``request_timeout`` in the envelope and closes the connection (a request whose
answer has begun, a refusal before its body was read, is left alone). Both parsers get these
deadlines.

:class:`CappedH11` (``--http h11``) caps h11's heads the same way, measuring them as their bytes
arrive.

It builds on uvicorn's ``HttpToolsProtocol`` and ``H11Protocol`` through asyncio's
``connection_made``, ``data_received`` and ``connection_lost``, httptools' ``on_url``,
``on_header``, ``on_headers_complete`` and ``on_message_complete`` callbacks, and h11's
connection states; tests/test_fuzz.py sends an unfinished 66 KiB head, a 100 KB head in one
write and an endless header to a real server with each parser, and tests/test_dropin.py
sends heads and bodies too slowly.
"""

from __future__ import annotations

import asyncio
from functools import partial
from http import HTTPStatus
from typing import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .envelope import error_response

#: The largest request head (request line and headers) either parser accepts.
HEAD_CAP_BYTES = 64 * 1024
#: What a request line adds to its target beside the method: " HTTP/1.1" and two line ends, at most.
_LINE_EXTRA = len(" HTTP/1.1\r\n\r\n")


def _raw_answer(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer in the envelope that closes the connection, for a protocol to write
    itself (before any application has the request)."""
    response = error_response(status, "invalid_request", reason, message)
    code = HTTPStatus(response.status_code)
    head = [f"HTTP/1.1 {code.value} {code.phrase}\r\n".encode()]
    head += [name + b": " + value + b"\r\n" for name, value in response.raw_headers]
    return b"".join(head) + b"connection: close\r\n\r\n" + response.body


#: A head past the cap's answer (the connection is closed after it).
TOO_LARGE = _raw_answer(
    431, "headers_too_large", f"the request head passes the limit of {HEAD_CAP_BYTES} bytes"
)
#: What a request the parser cannot read is answered (a bad Content-Length or chunk size, a length
#: beside chunked, a TLS hello on the plain port...): uvicorn does not pass the parser's reason on.
MALFORMED = _raw_answer(
    400,
    "malformed_http",
    "the request is not valid HTTP/1.1 (its request line, headers, length or "
    "chunks); the connection is closed",
)


class ReadDeadlines:
    """The two read deadlines of one connection: a head, then its body. ``expired(what)`` runs
    when one passes."""

    def __init__(self, head_s: float, body_s: float, expired: Callable[[str], None]) -> None:
        self.head_s, self.body_s, self._expired = head_s, body_s, expired
        self.phase: str | None = None  # "head", "body", or None (nothing being read)
        self._timer: asyncio.TimerHandle | None = None

    def reading_head(self) -> None:
        """A head is (or may be) arriving; its clock starts now unless it already runs."""
        if self.phase is None:
            self._arm("head", self.head_s)

    def head_done(self) -> None:
        """The head is whole: its body's clock starts (a message without a body ends it at once,
        below)."""
        if self.phase in (None, "head"):
            self._arm("body", self.body_s)

    def message_done(self) -> None:
        self._disarm()

    def close(self) -> None:
        self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self.phase = phase
        self._timer = asyncio.get_running_loop().call_later(seconds, self._fire, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self.phase = None, None

    def _fire(self, phase: str) -> None:
        self._timer, self.phase = None, None
        self._expired(phase)


def _timed_out_answer(phase: str, deadlines: ReadDeadlines) -> bytes:
    seconds = deadlines.head_s if phase == "head" else deadlines.body_s
    return _raw_answer(
        408, "request_timeout", f"the request {phase} did not arrive within {seconds:g} s"
    )


class _ReadGuard:
    """What both protocols add to uvicorn's: the read deadlines, and an answer of their own written
    before they close the connection (after which the parser's callbacks are for nobody:
    ``_refused``)."""

    def _guard(self, head_timeout_s: float, body_timeout_s: float) -> None:
        self._refused = False
        self._deadlines = ReadDeadlines(head_timeout_s, body_timeout_s, self._timed_out)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadlines.reading_head()

    def connection_lost(self, exc) -> None:
        self._deadlines.close()
        super().connection_lost(exc)

    def _timed_out(self, phase: str) -> None:
        if self.transport.is_closing() or (self.cycle is not None and self.cycle.response_started):
            # answered already (a refusal before the body was read): the body is nobody's concern
            return
        self._refuse(_timed_out_answer(phase, self._deadlines))

    def send_400_response(self, msg: str) -> None:
        # uvicorn's one hook for what its parser refuses (both protocols call it, then stop
        # reading): the envelope instead of its plain text. Mid-answer (a bad request pipelined
        # behind one being answered) nothing written could be told apart from that answer: the
        # connection is only closed.
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self._refused = True
            self.transport.close()
            return
        self._refuse(MALFORMED)

    def _refuse(self, answer: bytes) -> None:
        self._refused = True
        self._deadlines.close()
        self.transport.write(answer)
        self.transport.close()


class HeadCappedHttpTools(_ReadGuard, HttpToolsProtocol):
    """uvicorn's httptools protocol, answering 431 to a request head past HEAD_CAP_BYTES
    (unfinished, or whole) and 408 to a head or body that does not arrive in time."""

    def __init__(self, *args, head_timeout_s: float, body_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # a new connection's first bytes are a head
        self._head_bytes = 0  # bytes arrived while the head is unfinished
        self._head_size = 0  # the head's target and headers, as parsed
        self._guard(head_timeout_s, body_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._deadlines.reading_head()
            # Counted whole: a read that also holds the end of the head resets the count below, in
            # the parser's callback, so a small head followed by a large body in one read is not
            # mistaken for a large head.
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > HEAD_CAP_BYTES and not self.transport.is_closing():
            self._refuse(TOO_LARGE)

    def on_message_begin(self) -> None:
        self._head_size = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4  # ": " and the line's end
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        if self._head_size + len(self.parser.get_method()) + _LINE_EXTRA > HEAD_CAP_BYTES:
            self._refuse(TOO_LARGE)
            return
        self._deadlines.head_done()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._deadlines.message_done()
        super().on_message_complete()
        self._in_head = True  # what comes next on this connection starts a new head


class HeadMeter:
    """The size of a request head as its bytes arrive, whatever the reads: the bytes before its
    blank line."""

    END = b"\r\n\r\n"

    def __init__(self) -> None:
        self.size = 0  # the head's bytes so far (the whole head once it ended)
        self._tail = b""  # the last bytes seen, where the blank line may have begun

    def feed(self, data: bytes) -> bool:
        """Count ``data``; True when the head ended in it (``size`` is then the whole head's,
        blank line included)."""
        seen = self._tail + data
        end = seen.find(self.END)
        if end < 0:
            self.size += len(data)
            self._tail = seen[-(len(self.END) - 1) :]
            return False
        self.size += end + len(self.END) - len(self._tail)
        return True

    def reset(self) -> None:
        self.size, self._tail = 0, b""


class CappedH11(_ReadGuard, H11Protocol):
    """uvicorn's h11 protocol with the head capped as the httptools one (h11's own cap lets a whole
    head of any size through when it comes in one read) and the same read deadlines, from h11's
    states."""

    def __init__(self, *args, head_timeout_s: float, body_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._guard(head_timeout_s, body_timeout_s)
        self._head = HeadMeter()

    def data_received(self, data: bytes) -> None:
        if self._refused or self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE:  # these bytes begin, or go on with, a head
            ended = self._head.feed(data)
            if self._head.size > HEAD_CAP_BYTES:
                self._refuse(TOO_LARGE)
                return
            if ended:
                self._head.reset()
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # a head arriving (this read's bytes are part of it)
            self._deadlines.reading_head()
        elif state is h11.SEND_BODY:
            self._deadlines.head_done()
        else:  # DONE (or closing): nothing more to read for this request
            self._deadlines.message_done()


def http_options(http: str, head_timeout_s: float, body_timeout_s: float) -> dict:
    """uvicorn.Config's arguments for ``--http``: httptools (the default, capped here) or h11
    (capped by h11), each with the read deadlines.

    Both answer a head past the cap with 431 in the envelope (h11's own cap stays behind it, for a
    head h11 holds unfinished). No WebSocket protocol (``ws="none"``): the gate has no WebSocket
    route, and uvicorn's would refuse an ``Upgrade: websocket`` with its own plain 403; without it,
    such a request is an HTTP request like any other, answered by the app.
    """
    timeouts = {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s}
    if http == "h11":
        return {
            "http": partial(CappedH11, **timeouts),
            "ws": "none",
            "h11_max_incomplete_event_size": HEAD_CAP_BYTES,
        }
    return {"http": partial(HeadCappedHttpTools, **timeouts), "ws": "none"}
