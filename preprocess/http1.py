"""A small HTTP/1.1 response reader for servers that may be hostile.

`http.client` trusts its peer in ways a media fetcher cannot afford: it reads status lines, 1xx
responses, chunk-size lines and trailers through a buffered file whose reads a caller cannot bound
in time (a server dripping a byte at a time holds the thread as long as it likes), it reads
trailers with no size limit at all, and it turns a malformed number into a bare ValueError. Here
every receive is armed with what is left of one deadline, every part of the response has a byte
budget, and every way a server can break the protocol is a typed `PreprocessError`.

Only what a single GET with `Connection: close` needs: no keep-alive, no request bodies, no
content codings (the request asks for identity).
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass

from mmworker.preprocess.errors import BadResponse, FetchFailed, FetchTimeout, TooLarge

#: Interim (1xx) responses tolerated before the final one; real servers send one or two.
MAX_INTERIM = 8
#: Status lines and header fields of every head of one response (interim ones included).
MAX_HEAD_BYTES = 64 * 1024
#: Header fields in one head, and trailer fields after a chunked body.
MAX_FIELDS = 100
MAX_TRAILER_BYTES = 16 * 1024
#: One chunk-size line, extensions included.
MAX_CHUNK_LINE = 4096
#: Chunk framing (size lines, CRLFs) allowed on top of max_bytes // 16: a body sent in absurdly
#: small chunks, or with huge chunk extensions, is wire traffic the byte limit would not see.
FRAMING_ALLOWANCE = 64 * 1024

_RECV = 64 * 1024
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_DIGITS = re.compile(r"[0-9]+")  # not \d, which takes any Unicode digit
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")


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
        self._buf = bytearray()

    # --- heads ----------------------------------------------------------------------------

    def head(self) -> Head:
        """The final response head, after at most `MAX_INTERIM` interim ones."""
        budget = MAX_HEAD_BYTES
        for _ in range(MAX_INTERIM + 1):
            head, used = self._head(budget)
            budget -= used
            if head.status >= 200:
                return head
            if head.status == 101:
                raise BadResponse(f"{self._shown} switched protocols, which was not asked for")
        raise BadResponse(f"{self._shown} sent more than {MAX_INTERIM} interim (1xx) responses")

    def _head(self, budget: int) -> tuple[Head, int]:
        line, used = self._line(budget, "response head")
        match = _STATUS_LINE.fullmatch(line)
        if match is None:
            raise BadResponse(f"{self._shown} sent a malformed status line {line[:80]!r}")
        status = int(match.group(1))
        if not 100 <= status <= 599:
            raise BadResponse(f"{self._shown} sent status {status}, outside 100-599")
        fields, more = self._fields(budget - used, "response head")
        reason = (match.group(2) or b"").decode("latin-1").strip()
        return Head(status, reason, fields), used + more

    def _fields(self, budget: int, what: str) -> tuple[tuple[tuple[str, str], ...], int]:
        fields: list[tuple[str, str]] = []
        used = 0
        while True:
            line, size = self._line(budget - used, what)
            used += size
            if not line:
                return tuple(fields), used
            if line[:1] in (b" ", b"\t"):  # obsolete line folding: a continuation (RFC 9112 §5.2)
                if not fields:
                    raise BadResponse(f"the {what} from {self._shown} starts with a continuation")
                key, value = fields[-1]
                fields[-1] = (key, f"{value} {_value(line, what, self._shown)}")
                continue
            if len(fields) >= MAX_FIELDS:
                raise BadResponse(f"the {what} from {self._shown} has over {MAX_FIELDS} fields")
            name, colon, raw = line.partition(b":")
            if not colon or _TOKEN.fullmatch(name) is None:
                raise BadResponse(
                    f"the {what} from {self._shown} has a malformed field {line[:80]!r}"
                )
            fields.append((name.decode("ascii").lower(), _value(raw, what, self._shown)))

    # --- bodies ---------------------------------------------------------------------------

    def body(self, head: Head, max_bytes: int) -> bytes:
        codings = [
            c.strip().lower() for v in head.get_all("transfer-encoding") for c in v.split(",")
        ]
        if codings:
            # Transfer-Encoding overrides Content-Length (RFC 9112 §6.3); only plain chunked is
            # decodable, as identity was the only content coding asked for.
            if codings != ["chunked"]:
                raise BadResponse(
                    f"{self._shown} used transfer coding {', '.join(codings)[:80]!r}; only "
                    "chunked is supported"
                )
            return self._chunked(max_bytes)
        length = self._content_length(head, max_bytes)
        if length is None:
            return self._until_close(max_bytes)
        return self._exactly(length)

    def _content_length(self, head: Head, max_bytes: int) -> int | None:
        values = {item.strip() for v in head.get_all("content-length") for item in v.split(",")}
        if not values:
            return None
        if len(values) > 1:
            raise BadResponse(f"{self._shown} sent conflicting Content-Length values")
        (text,) = values
        if _DIGITS.fullmatch(text) is None:
            raise BadResponse(f"{self._shown} sent Content-Length {text[:40]!r}, not a number")
        digits = text.lstrip("0") or "0"
        if len(digits) > 18:  # int() of thousands of digits is slow, and refused past 4,300
            raise TooLarge(
                f"{self._shown} declares a {len(digits)}-digit length; the limit is {max_bytes}"
            )
        length = int(digits)
        if length > max_bytes:
            raise TooLarge(f"{self._shown} declares {length} bytes; the limit is {max_bytes}")
        return length

    def _exactly(self, length: int) -> bytes:
        parts: list[bytes] = []
        left = length
        while left:
            data = self._read(left)
            if not data:
                raise FetchFailed(f"{self._shown} closed the connection {left} bytes early")
            parts.append(data)
            left -= len(data)
        return b"".join(parts)

    def _until_close(self, max_bytes: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while data := self._read(_RECV):
            total += len(data)
            if total > max_bytes:
                raise TooLarge(f"{self._shown} sent more than the limit of {max_bytes} bytes")
            parts.append(data)
        return b"".join(parts)

    def _chunked(self, max_bytes: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        framing = FRAMING_ALLOWANCE + max_bytes // 16
        while True:
            line, used = self._line(min(MAX_CHUNK_LINE, framing), "chunk framing")
            framing -= used
            size_text = line.split(b";", 1)[0].strip(b" \t")
            if _HEX.fullmatch(size_text) is None:
                raise BadResponse(f"{self._shown} sent a malformed chunk size {line[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                break
            if total + size > max_bytes:
                raise TooLarge(f"{self._shown} sent more than the limit of {max_bytes} bytes")
            parts.append(self._exactly(size))
            total += size
            end, used = self._line(min(2, framing), "chunk framing")
            framing -= used
            if end:
                raise BadResponse(f"a chunk from {self._shown} is longer than its declared size")
        # Trailers are read only to reach the end of the message: their content is not used.
        self._fields(MAX_TRAILER_BYTES, "trailer section")
        return b"".join(parts)

    # --- the socket -----------------------------------------------------------------------

    def _line(self, limit: int, what: str) -> tuple[bytes, int]:
        """The next line without its terminator, and the bytes it took; `limit` bounds those."""
        scanned = 0
        while True:
            end = self._buf.find(b"\n", scanned)
            if end >= 0:
                if end + 1 > limit:
                    break
                line = bytes(self._buf[:end])
                del self._buf[: end + 1]
                if b"\r" in line[:-1]:
                    raise BadResponse(f"the {what} from {self._shown} has a bare CR")
                return line.removesuffix(b"\r"), end + 1
            if len(self._buf) >= limit:
                break
            scanned = len(self._buf)
            data = self._recv(_RECV)
            if not data:
                raise FetchFailed(f"{self._shown} closed the connection during the {what}")
            self._buf += data
        raise BadResponse(f"the {what} from {self._shown} is over its limit")

    def _read(self, size: int) -> bytes:
        if self._buf:
            data = bytes(self._buf[:size])
            del self._buf[:size]
            return data
        return self._recv(min(size, _RECV))

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


def _value(raw: bytes, what: str, shown: str) -> str:
    value = raw.strip(b" \t")
    if b"\x00" in value:
        raise BadResponse(f"the {what} from {shown} has a NUL byte in a field value")
    return value.decode("latin-1")
