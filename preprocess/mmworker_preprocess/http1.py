"""One HTTP/1.1 exchange with a server that may be hostile: h11 parses, this module bounds.

`http.client` trusts its peer in ways a media fetcher cannot afford: it reads status lines, 1xx
responses, chunk-size lines and trailers through a buffered file whose reads a caller cannot bound
in time (a server dripping a byte at a time holds the thread as long as it likes), it reads
trailers with no size limit at all, and it turns a malformed number into a bare ValueError.
h11 parses only the bytes it is handed, so the socket stays here: every receive is armed with what
is left of one deadline, every part of the response has a byte budget, and every way a server can
break the protocol is a typed `PreprocessError`.

What h11 accepts and a fetcher must not is refused here: a status over 599, more than
`MAX_FIELDS` fields, and a status line that is not HTTP/1.0 or 1.1 or has control characters in
its reason (which reaches logs and dead-letter records). That line is checked as soon as it is
in: h11 parses a head only once all of it has come, and a server that sent "SSH-2.0-..." and
waits must fail at once, not at the deadline. h11 refuses a Content-Length of over 20 digits as
malformed; it stays `TooLarge` here, since what it declares is a body no limit allows. A
connection closed before the message ended is `FetchFailed` (retryable), not a broken response.
One leniency is lost to h11: white space between a chunk size and its extensions ("4 ; x"),
which RFC 9112 tolerates, is refused as a malformed chunk header.

Only what a single GET with `Connection: close` needs: no keep-alive, no request bodies, no
content codings (the request asks for identity).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import h11

from mmworker_preprocess.errors import BadResponse, FetchFailed, FetchTimeout, TooLarge

#: Interim (1xx) responses tolerated before the final one; real servers send one or two.
MAX_INTERIM = 8
#: Every head of one response together (interim ones included); also h11's limit on one
#: incomplete event, which bounds one chunk-size line and the trailer section.
MAX_HEAD_BYTES = 64 * 1024
#: Header fields in one head, and trailer fields after a chunked body.
MAX_FIELDS = 100
#: Chunk framing (size lines, CRLFs, trailers) allowed on top of max_bytes // 16: a body sent in
#: absurdly small chunks, or with huge chunk extensions, is wire traffic the byte limit would
#: not see.
FRAMING_ALLOWANCE = 64 * 1024

_RECV = 64 * 1024
#: Stricter than h11: HTTP/1.0 or 1.1 only, and no control characters in the reason phrase,
#: which reaches logs and dead-letter records.
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
_HUGE_LENGTH = re.compile(rb"^content-length:[ \t]*[0-9]{21}", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Head:
    status: int
    reason: str
    #: (lower-case name, value) in arrival order; values are latin-1 decoded.
    fields: tuple[tuple[str, str], ...]

    def get_all(self, name: str) -> list[str]:
        return [value for key, value in self.fields if key == name]

    def get(self, name: str) -> str | None:
        values = self.get_all(name)
        return values[0] if values else None


class Reader:
    def __init__(self, sock: socket.socket, deadline: float, shown: str) -> None:
        self._sock = sock
        self._deadline = deadline
        self._shown = shown
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._received = 0
        self._closed = False
        #: The heads as they arrived: h11 parses a head only once its blank line has come, so a
        #: status line that is not HTTP is caught here, before a server holding back the rest of
        #: its "head" runs out the deadline.
        self._heads = bytearray()
        self._head_start = 0  # where the head being read begins in `_heads`
        self._scanned: int | None = 0  # how far its status line was searched; None once checked

    def request(self, target: str, headers: dict[str, str]) -> bytes:
        """The bytes of the GET to send: h11 frames the response by the request it saw."""
        fields = list(headers.items())
        start = self._conn.send(h11.Request(method="GET", target=target, headers=fields))
        return (start or b"") + (self._conn.send(h11.EndOfMessage()) or b"")

    # --- heads ----------------------------------------------------------------------------

    def head(self) -> Head:
        """The final response head, after at most `MAX_INTERIM` interim ones."""
        for _ in range(MAX_INTERIM + 1):
            try:
                event = self._next(MAX_HEAD_BYTES, self._head_bytes)
            except BadResponse:
                if _HUGE_LENGTH.search(self._heads, self._head_start):
                    raise TooLarge(
                        f"{self._shown} declares a Content-Length of over 20 digits"
                    ) from None
                raise
            if not isinstance(event, h11.InformationalResponse | h11.Response):
                raise FetchFailed(f"{self._shown} closed the connection during the response head")
            if event.status_code > 599:
                raise BadResponse(f"{self._shown} sent status {event.status_code}, outside 100-599")
            if len(event.headers) > MAX_FIELDS:
                raise BadResponse(
                    f"the response head from {self._shown} has over {MAX_FIELDS} fields"
                )
            fields = tuple((n.decode("ascii"), v.decode("latin-1")) for n, v in event.headers)
            if isinstance(event, h11.Response):
                self._heads = bytearray()
                return Head(event.status_code, event.reason.decode("latin-1").strip(), fields)
            self._head_start = len(self._heads) - len(self._conn.trailing_data[0])
            self._scanned = self._head_start
            self._head_bytes(b"")  # the next head may have come with this one
        raise BadResponse(f"{self._shown} sent more than {MAX_INTERIM} interim (1xx) responses")

    def _head_bytes(self, data: bytes) -> None:
        self._heads += data
        if self._scanned is None:
            return
        end = self._heads.find(b"\n", self._scanned)
        if end < 0:
            self._scanned = len(self._heads)
            return
        line = bytes(self._heads[self._head_start : end]).removesuffix(b"\r")
        if _STATUS_LINE.fullmatch(line) is None:
            raise BadResponse(f"{self._shown} sent a malformed status line {line[:80]!r}")
        self._scanned = None

    # --- bodies ---------------------------------------------------------------------------

    def body(self, head: Head, max_bytes: int) -> bytes:
        length = head.get("content-length")  # h11 checked it (at most 20 digits) and folded
        if length is not None and head.get("transfer-encoding") is None and int(length) > max_bytes:
            raise TooLarge(f"{self._shown} declares {length} bytes; the limit is {max_bytes}")
        parts: list[bytes] = []
        total = 0
        framing = FRAMING_ALLOWANCE + max_bytes // 16
        start = self._received - len(self._conn.trailing_data[0])  # where the body began
        while True:
            # Whatever arrives beyond the body's own bytes is framing, and it has a budget.
            event = self._next(start + total + framing)
            if isinstance(event, h11.Data):
                total += len(event.data)
                if total > max_bytes:
                    raise TooLarge(f"{self._shown} sent more than the limit of {max_bytes} bytes")
                parts.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                # Trailers are read only to reach the end of the message: their content is unused.
                if len(event.headers) > MAX_FIELDS:
                    raise BadResponse(
                        f"the trailers from {self._shown} have over {MAX_FIELDS} fields"
                    )
                return b"".join(parts)
            else:
                raise FetchFailed(f"{self._shown} closed the connection early")

    # --- the socket -----------------------------------------------------------------------

    def _next(self, limit: int, seen: Callable[[bytes], None] | None = None) -> h11.Event:
        """h11's next event, receiving while it needs data; no more than `limit` bytes of the
        response are received in all."""
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                if self._closed:
                    why = f": {exc}" if self._received else " without a response"
                    raise FetchFailed(f"{self._shown} closed the connection early{why}") from None
                raise BadResponse(f"{self._shown} broke HTTP/1.1: {str(exc)[:200]}") from None
            if isinstance(event, h11.Event):
                return event
            if event is h11.PAUSED or self._closed:
                raise FetchFailed(f"{self._shown} closed the connection early")
            room = limit - self._received
            if room <= 0:
                raise BadResponse(f"the response from {self._shown} is over its byte limit")
            data = self._recv(min(room, _RECV))
            self._received += len(data)
            self._closed = not data
            if seen is not None:
                seen(data)
            self._conn.receive_data(data)

    def _recv(self, size: int) -> bytes:
        """One receive, never waiting past the deadline: a read timeout alone would let a server
        that sends a byte just before each timeout hold the fetch forever."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise FetchTimeout(f"fetching {self._shown} ran past the time limit")
        self._sock.settimeout(left)
        try:
            return self._sock.recv(size)
        except TimeoutError:
            raise FetchTimeout(f"fetching {self._shown} ran past the time limit") from None
        except OSError as exc:
            raise FetchFailed(f"reading from {self._shown} failed: {exc!r}") from None
