"""fetch_bytes against servers on 127.0.0.1 that drip, flood or lie, and fetches stopped by their
job. Every server here is a raw socket in a thread, so it can break HTTP in ways a real server
library would not let it."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mmworker_preprocess import fetch
from mmworker_preprocess.errors import (
    BadResponse,
    FetchAborted,
    FetchFailed,
    FetchTimeout,
    MalformedUri,
    PreprocessError,
    TooLarge,
)
from mmworker_preprocess.fetch import FetchHandle, fetch_bytes
from mmworker_preprocess.params import FetchPolicy
from mmworker_schemas import Job, MediaRef
from mmworker_schemas.codes import ErrorCode

from mmworker.cache import DiskFeatureCache
from mmworker.config import PreprocessConfig
from mmworker.media import MediaStage

#: A deadline much shorter than what each dripping server would take to finish.
DEADLINE = 0.6
#: What a dripping server waits between two bytes: far inside any per-read timeout.
DRIP = 0.03


class RawServer:
    """Accepts on 127.0.0.1 and runs `script(server, conn)` for each connection in a thread."""

    def __init__(self, script: Callable[[RawServer, socket.socket], None]) -> None:
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.port: int = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.connections = 0
        self.sent = 0
        self.requests: list[bytes] = []
        #: Set when a script's send failed or its read saw end of stream: the client went away.
        self.client_gone = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._conns.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.script(self, conn)
        except OSError:
            self.client_gone.set()
        finally:
            conn.close()

    def read_request(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                self.client_gone.set()
                raise ConnectionResetError("client closed before its request ended")
            data += chunk
        self.requests.append(data)
        return data

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def drip(self, conn: socket.socket, data: Iterable[int], seconds: float = 10.0) -> None:
        """One byte every DRIP seconds until the client leaves (or, failing the test, a while)."""
        until = time.monotonic() + seconds
        for byte in data:
            if self.stop.is_set() or time.monotonic() > until:
                return
            self.send(conn, bytes([byte]))
            time.sleep(DRIP)

    def flood(self, conn: socket.socket, block: bytes, limit: int = 1 << 30) -> None:
        """`block` again and again as fast as the client takes it (up to `limit` bytes)."""
        while self.sent < limit and not self.stop.is_set():
            self.send(conn, block)

    def hold(self, conn: socket.socket) -> None:
        """Say nothing; return once the client has gone away."""
        conn.settimeout(0.05)
        while not self.stop.is_set():
            try:
                if not conn.recv(4096):
                    self.client_gone.set()
                    return
            except TimeoutError:
                continue

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        self._thread.join(2)
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[RawServer, socket.socket], None]], RawServer]]:
    servers: list[RawServer] = []

    def start(script: Callable[[RawServer, socket.socket], None]) -> RawServer:
        server = RawServer(script)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _policy(**kw: object) -> FetchPolicy:
    return FetchPolicy(allow_private_networks=True, **kw)  # type: ignore[arg-type]


def _url(server: RawServer, path: str = "/m.png") -> MediaRef:
    return MediaRef(uri=f"http://127.0.0.1:{server.port}{path}")


def _forever(prefix: bytes, repeat: bytes) -> Iterator[int]:
    yield from prefix
    while True:
        yield from repeat


def _timed_failure(ref: MediaRef, policy: FetchPolicy) -> tuple[PreprocessError, float]:
    started = time.monotonic()
    with pytest.raises(PreprocessError) as info:
        fetch_bytes(ref, policy)
    return info.value, time.monotonic() - started


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

# --- drips: the deadline holds on every receive -------------------------------------------------

#: (what is sent at once, what then drips forever): each phase of a response the old code read
#: with nothing but a per-read timeout that every dripped byte re-armed.
DRIPS = {
    "status line": (b"", _forever(b"HTTP/1.1 200 OK", b"K")),
    "header field": (b"HTTP/1.1 200 OK\r\n", _forever(b"X-Drip: ", b"a")),
    "many header fields": (b"HTTP/1.1 200 OK\r\n", _forever(b"", b"X: y\r\n")),
    "interim responses": (b"HTTP/1.1 100 Continue\r\n\r\n", _forever(b"HTTP/1.1 1", b"0")),
    "chunk-size line": (CHUNKED_HEAD, _forever(b"4;ext=", b"a")),
    "chunk data": (CHUNKED_HEAD, _forever(b"ffff\r\n", b"d")),
    "trailers": (CHUNKED_HEAD + b"4\r\ndata\r\n0\r\n", _forever(b"X-Trailer: ", b"t")),
}


@pytest.mark.parametrize("phase", list(DRIPS))
def test_a_dripping_server_is_cut_off_at_the_deadline_in_every_phase(serve, phase):
    at_once, dripped = DRIPS[phase]

    def script(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        server.send(conn, at_once)
        server.drip(conn, dripped)

    server = serve(script)
    error, elapsed = _timed_failure(_url(server), _policy(timeout_s=DEADLINE))
    assert isinstance(error, FetchTimeout), error
    assert error.code is ErrorCode.FETCH_TIMEOUT
    assert DEADLINE - 0.05 < elapsed < DEADLINE + 1.0
    assert server.client_gone.wait(2), "the fetch must close its connection when it gives up"


def test_a_tls_handshake_that_drips_is_cut_off_at_the_deadline(serve, monkeypatch):
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: ["127.0.0.1"])

    def script(server: RawServer, conn: socket.socket) -> None:
        conn.recv(4096)  # the ClientHello
        # A handshake record header promising 16 KB, then the record one byte at a time.
        server.send(conn, b"\x16\x03\x03\x40\x00")
        server.drip(conn, _forever(b"\x02", b"\x00"))

    server = serve(script)
    ref = MediaRef(uri=f"https://media.test:{server.port}/m.png")
    error, elapsed = _timed_failure(ref, _policy(timeout_s=DEADLINE))
    assert isinstance(error, FetchTimeout), error
    assert elapsed < DEADLINE + 1.0


def test_one_deadline_covers_a_chain_of_slow_redirects(serve):
    def script(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        time.sleep(0.2)  # each hop alone is well inside the deadline
        server.send(conn, b"HTTP/1.1 302 Found\r\nLocation: /again\r\nContent-Length: 0\r\n\r\n")

    server = serve(script)
    error, elapsed = _timed_failure(_url(server), _policy(timeout_s=DEADLINE, max_redirects=20))
    assert isinstance(error, FetchTimeout), error
    assert elapsed < DEADLINE + 1.0
    assert 2 <= server.connections <= 4


# --- floods: every part of a response has a byte budget -----------------------------------------

#: (head sent first, block repeated as fast as the client reads it, error expected).
FLOODS = {
    "one endless header line": (b"HTTP/1.1 200 OK\r\nX-Flood: ", b"a" * 65536, BadResponse),
    "endless header fields": (b"HTTP/1.1 200 OK\r\n", b"X-Flood: a\r\n" * 512, BadResponse),
    "endless interim responses": (b"", b"HTTP/1.1 100 Continue\r\n\r\n" * 64, BadResponse),
    "endless status line": (b"HTTP/1.1 200 ", b"K" * 65536, BadResponse),
    "endless trailer fields": (
        CHUNKED_HEAD + b"4\r\ndata\r\n0\r\n",
        b"X-Trailer: " + b"t" * 100 + b"\r\n",
        BadResponse,
    ),
    "one endless trailer line": (
        CHUNKED_HEAD + b"4\r\ndata\r\n0\r\nX-Trailer: ",
        b"t" * 65536,
        BadResponse,
    ),
    "chunk extensions with one byte of data each": (
        CHUNKED_HEAD,
        b"1;" + b"e" * 4000 + b"\r\nx\r\n",
        BadResponse,
    ),
    "one endless chunk-size line": (CHUNKED_HEAD + b"1", b"0" * 65536, BadResponse),
    "an endless body without a length": (b"HTTP/1.1 200 OK\r\n\r\n", b"b" * 65536, TooLarge),
}


@pytest.mark.parametrize("kind", list(FLOODS))
def test_a_flooding_server_hits_a_typed_permanent_limit_fast(serve, kind):
    head, block, expected = FLOODS[kind]

    def script(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        server.send(conn, head)
        server.flood(conn, block)

    server = serve(script)
    error, elapsed = _timed_failure(_url(server), _policy(timeout_s=10.0, max_bytes=1 << 20))
    assert type(error) is expected, error
    assert not error.retryable
    assert elapsed < 3.0, "a limit, not the 10 s deadline, must stop it"
    assert server.client_gone.wait(2)
    # Bounded by the limits plus what the kernel buffers took, far from the old 2.2 GB.
    assert server.sent < 48 << 20


# --- lies: every malformed response is a typed, permanent failure -------------------------------

LIES = {
    "superscript Content-Length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\nxx",
        BadResponse,
    ),
    "superscript Content-Length, UTF-8": (
        b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\nxx",
        BadResponse,
    ),
    "5,000-digit Content-Length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
        TooLarge,
    ),
    "negative Content-Length": (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", BadResponse),
    "float Content-Length": (b"HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n", BadResponse),
    "conflicting Content-Lengths": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\ndata",
        BadResponse,
    ),
    "compressed transfer coding": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        BadResponse,
    ),
    "non-hex chunk size": (CHUNKED_HEAD + b"zz\r\n", BadResponse),
    "chunk longer than declared": (CHUNKED_HEAD + b"2\r\ndata\r\n0\r\n\r\n", BadResponse),
    "malformed status code": (b"HTTP/1.1 2OO OK\r\n\r\n", BadResponse),
    "20-digit Content-Length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 20 + b"\r\n\r\n",
        TooLarge,
    ),
    "HTTP/2.0 status line": (b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n", BadResponse),
    "control character in the reason": (
        b"HTTP/1.1 200 O\x1bK\r\nContent-Length: 0\r\n\r\n",
        BadResponse,
    ),
    "not HTTP after an interim response": (
        b"HTTP/1.1 100 Continue\r\n\r\nSSH-2.0-OpenSSH_9.6\r\n",
        BadResponse,
    ),
    "101 header fields": (b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n", BadResponse),
    "101 trailer fields": (CHUNKED_HEAD + b"0\r\n" + b"X: y\r\n" * 101 + b"\r\n", BadResponse),
    "not HTTP at all": (b"SSH-2.0-OpenSSH_9.6\r\n", BadResponse),
    "status out of range": (b"HTTP/1.1 999 Nine\r\nContent-Length: 0\r\n\r\n", BadResponse),
    "field without a colon": (b"HTTP/1.1 200 OK\r\nNoColonHere\r\n\r\n", BadResponse),
    "space before the colon": (b"HTTP/1.1 200 OK\r\nContent-Length : 4\r\n\r\ndata", BadResponse),
    "NUL in a field value": (b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\n\r\n", BadResponse),
    "bare CR in a field": (b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\n\r\n", BadResponse),
    "unasked protocol switch": (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", BadResponse),
    "redirect without Location": (b"HTTP/1.1 302 Found\r\nContent-Length: 0\r\n\r\n", BadResponse),
    "redirect to a broken IPv6 literal": (
        b"HTTP/1.1 302 Found\r\nLocation: http://[::1/x\r\n\r\n",
        BadResponse,
    ),
    "redirect to a bracketed name": (
        b"HTTP/1.1 302 Found\r\nLocation: http://[evil.test]/\r\n\r\n",
        BadResponse,
    ),
    "redirect to an IPv6 zone id": (
        b"HTTP/1.1 302 Found\r\nLocation: http://[fe80::1%25eth0]/\r\n\r\n",
        MalformedUri,
    ),
    "redirect to a name with a space": (
        b"HTTP/1.1 302 Found\r\nLocation: http://ex ample.test/\r\n\r\n",
        MalformedUri,
    ),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lying_server_is_a_typed_permanent_failure(serve, lie, monkeypatch):
    response, expected = LIES[lie]
    resolved: list[str] = []
    real_resolve = fetch._resolve
    monkeypatch.setattr(fetch, "_resolve", lambda h, p: resolved.append(h) or real_resolve(h, p))

    def script(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        server.send(conn, response)
        server.hold(conn)

    server = serve(script)
    error, elapsed = _timed_failure(_url(server), _policy(timeout_s=5.0))
    assert type(error) is expected, error
    assert not error.retryable
    assert error.code is not ErrorCode.INTERNAL_ERROR
    assert elapsed < 2.0
    assert resolved == ["127.0.0.1"], "a malformed redirect target must never be resolved"


#: Responses cut off by the server closing the connection: a retry may well succeed.
CUT_SHORT = {
    "no response at all": b"",
    "inside the head": b"HTTP/1.1 200 OK\r\nContent-Len",
    "inside a chunk": CHUNKED_HEAD + b"8\r\ndat",
    "before the last chunk": CHUNKED_HEAD + b"4\r\ndata\r\n",
}


@pytest.mark.parametrize("where", list(CUT_SHORT))
def test_a_connection_closed_mid_response_is_a_retryable_failure(serve, where):
    def script(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        server.send(conn, CUT_SHORT[where])

    server = serve(script)
    error, elapsed = _timed_failure(_url(server), _policy(timeout_s=5.0))
    assert type(error) is FetchFailed, error
    assert error.retryable
    assert elapsed < 2.0


# --- what is allowed still works ----------------------------------------------------------------

HONEST = {
    "interim responses first": b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\n"
    b"Link: </a.css>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndata",
    "chunks with extensions and trailers": CHUNKED_HEAD
    + b"2;name=val\r\nda\r\n2\r\nta\r\n0\r\nX-Checksum: abc\r\nX-More: 1\r\n\r\n",
    "bare LF line ends": b"HTTP/1.1 200 OK\nContent-Length: 4\n\ndata",
    "repeated equal Content-Lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 4, 4\r\n\r\ndata",
    "a folded field": b"HTTP/1.1 200 OK\r\nX-Long: a\r\n  b\r\nContent-Length: 4\r\n\r\ndata",
    "HTTP/1.0 until close": b"HTTP/1.0 200 OK\r\n\r\ndata",
    "no reason phrase": b"HTTP/1.1 200\r\nContent-Length: 4\r\n\r\ndata",
}


@pytest.mark.parametrize("case", list(HONEST))
def test_unusual_but_valid_responses_are_read(serve, case):
    def script(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        server.send(conn, HONEST[case])

    server = serve(script)
    assert fetch_bytes(_url(server), _policy(timeout_s=5.0)) == b"data"


def test_the_request_is_one_well_formed_get(serve, monkeypatch):
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: ["127.0.0.1"])

    def script(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndata")

    server = serve(script)
    ref = MediaRef(uri=f"http://B\u00fccher.Test:{server.port}/a b/\u00e9.png?x=1#frag")
    assert fetch_bytes(ref, _policy()) == b"data"
    request = server.requests[0]
    assert request.startswith(b"GET /a%20b/%C3%A9.png?x=1 HTTP/1.1\r\n")
    assert f"\r\nHost: xn--bcher-kva.test:{server.port}\r\n".encode() in request
    assert b"\r\nConnection: close\r\n" in request
    assert b"\r\nAccept-Encoding: identity\r\n" in request


# --- stopping a fetch its job gave up on ------------------------------------------------------


def _silent(server: RawServer, conn: socket.socket) -> None:
    server.read_request(conn)
    server.hold(conn)


def _make_tls(tmp_path: Path) -> ssl.SSLContext:
    """A client context trusting a throwaway CA (the server never completes a handshake)."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_abort_returns_the_fetch_thread_at_once(serve, scheme, monkeypatch, tmp_path):
    """Waiting for a response (http) or inside the TLS handshake (https), with a 30 s deadline."""
    if scheme == "https":
        monkeypatch.setattr(fetch, "_tls_context", lambda: _make_tls(tmp_path))
        server = serve(lambda server, conn: server.hold(conn))
    else:
        server = serve(_silent)
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: ["127.0.0.1"])
    handle = FetchHandle()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            fetch_bytes(MediaRef(uri=f"{scheme}://media.test:{server.port}/m"), _policy(), handle)
        except PreprocessError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while server.connections == 0 or (scheme == "http" and not server.requests):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)  # well inside the blocking receive
    started = time.monotonic()
    handle.abort()
    thread.join(2)
    assert not thread.is_alive()
    assert time.monotonic() - started < 1.0
    assert len(outcome) == 1 and type(outcome[0]) is FetchAborted, outcome
    assert server.client_gone.wait(2)


def test_a_fetch_aborted_before_it_starts_never_connects(serve):
    server = serve(_silent)
    handle = FetchHandle()
    handle.abort()
    with pytest.raises(FetchAborted):
        fetch_bytes(_url(server), _policy(), handle)
    time.sleep(0.1)
    assert server.connections == 0


def test_abort_after_the_fetch_is_harmless(serve):
    def script(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndata")

    server = serve(script)
    handle = FetchHandle()
    assert fetch_bytes(_url(server), _policy(), handle) == b"data"
    handle.abort()
    handle.abort()
    assert handle.aborted


def _stage(tmp_path: Path) -> tuple[MediaStage, ThreadPoolExecutor, ThreadPoolExecutor]:
    cfg = PreprocessConfig(allow_private_networks=True, fetch_timeout_s=30.0)
    cache = DiskFeatureCache(tmp_path / "cache", max_bytes=16 * 1024 * 1024)
    cpu, io = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    return MediaStage(cfg, cache, cpu_pool=cpu, io_pool=io, writer=io), cpu, io


def _io_thread_free_within(io: ThreadPoolExecutor, seconds: float) -> bool:
    probe = io.submit(lambda: None)
    try:
        probe.result(timeout=seconds)
    except TimeoutError:
        return False
    return True


def test_a_job_timeout_frees_the_io_thread_of_its_fetch(serve, tmp_path):
    """The only I/O thread runs a fetch from a server that never answers (30 s deadline); the
    job gives up after 0.3 s and the thread must be free at once, not 30 s later."""
    server = serve(_silent)
    stage, cpu, io = _stage(tmp_path)
    job = Job(job_id="stuck", media=[_url(server)])

    async def give_up() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stage.prepare(job), timeout=0.3)

    asyncio.run(give_up())
    assert server.requests, "the fetch was running when the job gave up"
    assert _io_thread_free_within(io, 1.0)
    assert server.client_gone.wait(1)
    cpu.shutdown()
    io.shutdown()


def test_a_failed_item_stops_the_fetches_of_its_siblings(serve, tmp_path):
    stuck = serve(_silent)

    def lie_once_the_sibling_is_waiting(server: RawServer, conn: socket.socket) -> None:
        server.read_request(conn)
        while not stuck.requests:
            time.sleep(0.01)
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n")

    liar = serve(lie_once_the_sibling_is_waiting)
    stage, cpu, io = _stage(tmp_path)
    io2 = ThreadPoolExecutor(2)
    stage._io_pool = io2  # one thread for each item
    job = Job(job_id="mixed", media=[_url(stuck), _url(liar)])

    async def run() -> None:
        with pytest.raises(BadResponse):
            await stage.prepare(job)

    started = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - started < 2.0
    assert stuck.client_gone.wait(1), "the sibling's fetch must be stopped with the job"
    assert _io_thread_free_within(io2, 1.0)
    for pool in (cpu, io, io2):
        pool.shutdown()
