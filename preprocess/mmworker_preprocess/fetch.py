"""Fetch the bytes behind a `MediaRef` without letting a job read or reach what it should not.

URIs come from producers, so every fetch is treated as untrusted input: file:// is confined to
configured roots, and http(s):// refuses internal addresses (cloud metadata, loopback admin ports,
the private network) unless the operator opts in. Sizes and time are bounded because one slow or
huge download must not stall a worker that serves many jobs, and servers are treated as hostile
too: one wall-clock deadline covers every receive of the whole fetch (see
`mmworker_preprocess.http1`), and the job that started a fetch can stop it through a `FetchHandle`.

Synchronous by design: it runs in a thread or process pool next to decoding.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import ipaddress
import os
import re
import socket
import ssl
import stat
import threading
import time
from dataclasses import dataclass
from urllib.parse import quote, unquote, urljoin, urlsplit

from mmworker_schemas.job import MediaRef

from mmworker_preprocess import netpolicy
from mmworker_preprocess.errors import (
    BadResponse,
    ChecksumMismatch,
    FetchAborted,
    FetchFailed,
    FetchTimeout,
    ForbiddenUri,
    MalformedUri,
    PreprocessError,
    TooLarge,
)
from mmworker_preprocess.http1 import Reader
from mmworker_preprocess.netpolicy import forbidden_reason
from mmworker_preprocess.params import FetchPolicy

__all__ = ["FetchHandle", "check_allowed", "fetch_bytes", "forbidden_reason", "sha256_hex"]

_URL_SAFE = "/%:@!$&'()*+,;=?"
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_HEADERS = {
    "User-Agent": "mmworker-fetch/1",
    "Accept": "image/*, video/*;q=0.9, */*;q=0.5",
    # Compressed transfer would hide the real size from the byte limit, and media rarely shrinks.
    "Accept-Encoding": "identity",
    "Connection": "close",
}
#: One DNS label (RFC 1123, plus "_", which real hosts use) after IDNA encoding.
_LABEL = re.compile(r"[a-z0-9_-]{1,63}")
#: A last label of digits (or 0x-hex) makes the whole name an IPv4 literal, maybe a short one.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FetchHandle:
    """Lets whoever waits for a fetch stop it from another thread.

    A thread blocked in recv() cannot be interrupted, but shutting its socket down ends the read
    at once. A job that times out or is cancelled calls `abort()`, so the pool thread running its
    fetch is free again instead of serving a hostile server until the fetch deadline: otherwise a
    handful of such jobs, each retried, would hold every thread of the worker's I/O pool.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        """Stop the fetch: its thread raises `FetchAborted` promptly. Safe from any thread, any
        number of times, and before or after the fetch ran."""
        with self._lock:
            self._aborted = True
            sock = self._sock
            if sock is not None:
                # socket.socket's own shutdown, not SSLSocket's, which also drops its TLS state
                # under the feet of the thread reading it. OSError: not connected yet (the fetch
                # checks the flag after connecting) or already closed; nothing left to stop.
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def _hold(self, sock: socket.socket) -> None:
        with self._lock:
            if self._aborted:
                sock.close()
                raise FetchAborted("the fetch was stopped by the job that started it")
            self._sock = sock

    def _release(self, sock: socket.socket) -> None:
        """Forget `sock` before closing it, so that abort() never shuts down a reused fd."""
        with self._lock:
            if self._sock is sock:
                self._sock = None
        sock.close()

    def _check(self) -> None:
        if self._aborted:
            raise FetchAborted("the fetch was stopped by the job that started it")


def fetch_bytes(ref: MediaRef, policy: FetchPolicy, handle: FetchHandle | None = None) -> bytes:
    """Return the media bytes of `ref`, verified against `ref.sha256` when it is given.

    `handle`, when given, lets another thread stop an http(s) fetch in progress.
    """
    if ref.data is not None:
        data = ref.data
        if len(data) > policy.max_bytes:
            raise TooLarge(f"inline media is {len(data)} bytes; the limit is {policy.max_bytes}")
    elif ref.uri is not None and ref.uri.startswith("file://"):
        data = _read_file(ref.uri, policy)
    elif ref.uri is not None:
        data = _fetch_http(ref.uri, policy, handle or FetchHandle())
    else:  # pragma: no cover - MediaRef's validator guarantees one source
        raise ForbiddenUri("media ref has neither uri nor data")
    if ref.sha256 is not None:
        actual = sha256_hex(data)
        if actual != ref.sha256:
            raise ChecksumMismatch(f"sha256 of the media is {actual}; expected {ref.sha256}")
    return data


def check_allowed(ref: MediaRef, policy: FetchPolicy, handle: FetchHandle | None = None) -> None:
    """Raise what fetching `ref` would raise for its address alone, without reading anything.

    For a cache hit found by a declared sha256, which skips the fetch: the job must still be one
    this worker would have fetched (a forbidden URI stays forbidden when its content is cached).
    `handle`, when given, lets another thread stop its DNS lookup.
    """
    if ref.uri is None:
        return
    if ref.uri.startswith("file://"):
        _checked_path(ref.uri, policy)
    else:
        deadline = time.monotonic() + policy.timeout_s  # a lookup is bounded as in a fetch
        _vetted_addresses(_parse_http(ref.uri), policy, deadline, handle or FetchHandle())


# --- file:// ---------------------------------------------------------------------------------


def _checked_path(uri: str, policy: FetchPolicy) -> tuple[str, str]:
    """(path as given, real path inside an allowed root), or ForbiddenUri."""
    if not policy.allowed_roots:
        raise ForbiddenUri("file:// URIs are disabled: the worker has no allowed roots configured")
    try:
        parts = urlsplit(uri)
    except ValueError as exc:  # "file://[/x": an unclosed bracket reads as an IPv6 host
        raise MalformedUri(f"malformed URI {_clip(uri)}: {exc}") from None
    if parts.netloc not in ("", "localhost"):
        raise ForbiddenUri(f"file URI host must be empty or localhost, not {parts.netloc!r}")
    path = unquote(parts.path)
    if "\x00" in path or not os.path.isabs(path):
        raise ForbiddenUri(f"file URI path {path!r} is not an absolute path")
    # realpath resolves `..` and every symlink, so the containment test sees the real target.
    real = os.path.realpath(path)
    if not _in_roots(real, policy):
        raise ForbiddenUri(f"{path} is outside the allowed roots")
    return path, real


def _in_roots(real: str, policy: FetchPolicy) -> bool:
    return any(_is_within(real, os.path.realpath(root)) for root in policy.allowed_roots)


def _read_file(uri: str, policy: FetchPolicy) -> bytes:
    path, real = _checked_path(uri, policy)
    # O_NOFOLLOW closes the window where the checked path is swapped for a symlink before open;
    # O_NONBLOCK keeps a FIFO from blocking the open so the regular-file check can refuse it.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise FetchFailed(f"no such file: {path}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ForbiddenUri(f"{path} became a symlink while being opened") from None
        raise FetchFailed(f"cannot open {path}: {exc.strerror}") from None
    # O_NOFOLLOW guards the last component only: a parent directory swapped for a symlink between
    # the check and the open is caught by asking the kernel what was actually opened.
    opened = f"/proc/self/fd/{fd}"
    if os.path.exists(opened) and not _in_roots(os.path.realpath(opened), policy):
        os.close(fd)
        raise ForbiddenUri(f"{path} moved outside the allowed roots while being opened")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > policy.max_bytes:
        os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ForbiddenUri(f"{path} is not a regular file")
        raise TooLarge(f"{path} is {info.st_size} bytes; the limit is {policy.max_bytes}")
    with os.fdopen(fd, "rb") as fh:
        try:
            data = fh.read(policy.max_bytes + 1)
        except OSError as exc:
            raise FetchFailed(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > policy.max_bytes:  # the file grew after fstat
        raise TooLarge(f"{path} is over the limit of {policy.max_bytes} bytes")
    return data


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# --- http(s):// ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Target:
    scheme: str
    host: str  # ASCII (IDNA-encoded) name or IP literal, without brackets
    port: int
    netloc: str  # as sent in the Host header
    path: str  # path and query, as sent in the request line
    shown: str  # the URL without userinfo or query: signed URLs carry secrets in the query


def _fetch_http(uri: str, policy: FetchPolicy, handle: FetchHandle) -> bytes:
    """GET `uri`, following redirects by hand so that every hop's address is vetted.

    One deadline covers the whole fetch, redirects included: a chain of slow hops must not
    multiply the time limit.
    """
    deadline = time.monotonic() + policy.timeout_s
    url = uri
    try:
        for _ in range(policy.max_redirects + 1):
            handle._check()
            target = _parse_http(url)
            addresses = _vetted_addresses(target, policy, deadline, handle)
            location = _get(target, addresses, policy, deadline, handle)
            if isinstance(location, bytes):
                return location
            try:
                url = urljoin(url, location)
            except ValueError as exc:
                raise BadResponse(
                    f"{target.shown} redirected to a malformed URI {_clip(location)}: {exc}"
                ) from None
    except PreprocessError:
        # A stopped fetch surfaces as whatever the shut-down socket caused (end of stream,
        # broken pipe); say what really happened.
        if handle.aborted:
            raise FetchAborted("the fetch was stopped by the job that started it") from None
        raise
    raise FetchFailed(f"more than {policy.max_redirects} redirects fetching {_clip(uri)}")


def _clip(url: str) -> str:
    """`url` for an error message: no query or fragment (signed URLs carry secrets there)."""
    return repr(url.split("?", 1)[0].split("#", 1)[0][:200])


def _parse_http(url: str) -> _Target:
    """Split and check `url`; anything malformed is a permanent `MalformedUri`, never the bare
    ValueError urllib raises (which would be an internal error and a stack trace)."""
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise ForbiddenUri(
                f"only http:// and https:// URIs are fetched, not {scheme or 'a relative'}://"
            )
        explicit_port = parts.port
        raw_host = parts.hostname
        bracketed = "[" in parts.netloc.rpartition("@")[2]
        has_credentials = parts.username is not None or parts.password is not None
    except ValueError as exc:
        raise MalformedUri(f"malformed URI {_clip(url)}: {exc}") from None
    if explicit_port == 0:
        raise MalformedUri(f"URI has port 0: {_clip(url)}")
    if not raw_host:
        raise MalformedUri(f"URI has no host: {_clip(url)}")
    if has_credentials:
        raise ForbiddenUri("credentials in URIs are not supported")
    if bracketed and ":" not in raw_host:
        # "[evil.test]" or "[v1.x]" (IPvFuture): brackets hold IPv6 literals only, whatever the
        # Python patch release's urlsplit lets through.
        raise MalformedUri(f"URI host [{raw_host[:80]}] is not an IPv6 address: {_clip(url)}")
    host = _checked_host(raw_host, url)
    port = explicit_port or (443 if scheme == "https" else 80)
    netloc = f"[{host}]" if ":" in host else host
    if explicit_port:
        netloc += f":{port}"
    # Percent-encode what may not appear in a request line (spaces, controls, non-ASCII);
    # keep existing escapes.
    path = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe=_URL_SAFE)
    shown = f"{scheme}://{netloc}{parts.path[:200] or '/'}"
    return _Target(scheme, host, port, netloc, path, shown)


def _checked_host(host: str, url: str) -> str:
    """The host as it goes to the resolver and the Host header, or MalformedUri.

    A name the resolver can never answer (a space, a 64-character label) would otherwise fail as
    a retryable resolution error and be retried for nothing.
    """
    if "%" in host:  # an IPv6 zone id, or a percent-encoded name
        raise MalformedUri(f"URI host {host[:80]!r} has a zone id or a %-escape: {_clip(url)}")
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host).compressed
        except ValueError:
            raise MalformedUri(f"URI host {host[:80]!r} is not an IPv6 address") from None
    try:
        name = host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise MalformedUri(f"URI host {host[:80]!r} is not a valid host name") from None
    labels = name.removesuffix(".").split(".")
    if len(name.removesuffix(".")) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise MalformedUri(f"URI host {host[:80]!r} is not a valid host name")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        try:
            socket.inet_aton(name.removesuffix("."))
        except OSError:
            raise MalformedUri(f"URI host {host[:80]!r} is not a valid IPv4 address") from None
    return name


def _resolve(host: str, port: int) -> list[str]:
    """All addresses of `host`; a seam for tests, which point made-up names at a local server."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


#: Lookups left running at once, at most (see `_lookup`): a flood of names whose resolver never
#: answers waits for a slot, each within its own fetch's deadline, instead of adding threads
#: without end. Far above the I/O pool's threads: a few hostile names must not leave the other
#: jobs' fetches waiting for a slot.
_LOOKUPS = threading.BoundedSemaphore(256)
#: How often a fetch waiting for its lookup looks whether its job stopped it.
_LOOKUP_POLL_S = 0.05


def _lookup(target: _Target, deadline: float, handle: FetchHandle) -> list[str]:
    """`_resolve`, within the fetch's deadline and stoppable by its job.

    getaddrinfo cannot be interrupted and takes the resolver's own timeouts and retries (tens of
    seconds for a name server that never answers), which the fetch deadline did not bound: the
    job ran past its time limit, and its thread of the I/O pool with it. The lookup runs in a
    daemon thread of its own, which a fetch that gives up leaves to end in its own time.
    """
    if _is_ip_literal(target.host):
        return _resolve(target.host, target.port)  # no name server is asked
    answer: list[list[str] | Exception] = []
    done = threading.Event()
    # The slot goes back to the semaphore it came from, even if the module's is replaced while
    # the lookup runs (tests do): releasing the new one, full, raised in the lookup's thread.
    slots = _LOOKUPS

    def run() -> None:
        try:
            answer.append(_resolve(target.host, target.port))
        except Exception as exc:  # noqa: BLE001 - raised in the fetching thread, not lost
            answer.append(exc)
        finally:
            slots.release()
            done.set()

    while not slots.acquire(timeout=min(_LOOKUP_POLL_S, _remaining(deadline, target))):
        handle._check()
    try:
        threading.Thread(target=run, name="mmworker-dns", daemon=True).start()
    except RuntimeError:  # no thread to be had: the slot was not used
        slots.release()
        raise
    while not done.wait(_LOOKUP_POLL_S):
        handle._check()
        if time.monotonic() >= deadline:
            raise FetchTimeout(f"no DNS answer for {target.host} within the fetch time limit")
    if isinstance(answer[0], Exception):
        raise answer[0]
    return answer[0]


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _vetted_addresses(
    target: _Target, policy: FetchPolicy, deadline: float, handle: FetchHandle
) -> list[str]:
    """Resolve once and check every address; the connection then uses these, never a new lookup.

    Checking one lookup and connecting through another would let a DNS answer change in between
    (DNS rebinding). Any forbidden address fails the whole host, since a name that mixes public
    and internal addresses is either misconfigured or an attack.
    """
    try:
        addresses = _lookup(target, deadline, handle)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchFailed(f"cannot resolve {target.host}: {exc}") from None
    if not addresses:
        raise FetchFailed(f"{target.host} has no addresses")
    for address in addresses:
        try:
            # `forbidden_reason` is looked up here, in this module, on purpose: see refusal().
            refusal = netpolicy.refusal(address, policy, forbidden_reason)
        except ValueError:
            raise FetchFailed(
                f"{target.host} resolved to {address[:80]!r}, not an IP address", retryable=False
            ) from None
        if refusal is not None:
            raise ForbiddenUri(f"{target.shown} resolves to {address}, {refusal}")
    return addresses


def _get(
    target: _Target,
    addresses: list[str],
    policy: FetchPolicy,
    deadline: float,
    handle: FetchHandle,
) -> bytes | str:
    """One request: the body, or the Location of a redirect to follow."""
    sock = _connect(target, addresses, deadline, handle)
    try:
        reader = Reader(sock, deadline, target.shown)
        request = reader.request(target.path, {"Host": target.netloc, **_HEADERS})
        sock.settimeout(_remaining(deadline, target))
        sock.sendall(request)
        head = reader.head()
        if head.status in _REDIRECTS:
            location = head.get("location")
            if not location:
                raise BadResponse(f"HTTP {head.status} from {target.shown} without a Location")
            return location
        if head.status != 200:
            kind = "server error" if head.status >= 500 else "refused"
            raise FetchFailed(f"HTTP {head.status} {head.reason} ({kind}) from {target.shown}")
        return reader.body(head, policy.max_bytes)
    except TimeoutError:
        raise FetchTimeout(
            f"no complete response from {target.shown} within the time limit"
        ) from None
    except OSError as exc:
        raise FetchFailed(f"fetching {target.shown} failed: {exc!r}") from None
    finally:
        handle._release(sock)


def _connect(
    target: _Target, addresses: list[str], deadline: float, handle: FetchHandle
) -> socket.socket:
    """Connect (and for https, handshake) to the first vetted address that answers."""
    last: OSError | None = None
    for address in addresses:
        try:
            raw = _open_socket(address)
        except OSError as exc:  # no descriptors left (EMFILE), or IPv6 on an IPv4-only host
            last = exc
            continue
        handle._hold(raw)
        try:
            raw.settimeout(_remaining(deadline, target))
            raw.connect(_sockaddr(address, target.port))
            handle._check()  # an abort that came before connect() started found nothing to stop
        except TimeoutError:
            handle._release(raw)
            raise FetchTimeout(f"connecting to {target.shown} timed out") from None
        except OSError as exc:
            handle._release(raw)
            last = exc
            continue
        except BaseException:
            handle._release(raw)
            raise
        if target.scheme == "http":
            return raw
        return _handshake(raw, target, deadline, handle)
    handle._check()
    raise FetchFailed(f"cannot connect to {target.shown}: {last}")


def _handshake(
    raw: socket.socket, target: _Target, deadline: float, handle: FetchHandle
) -> socket.socket:
    """TLS over a connected socket; SNI and the certificate check use the hostname, never the
    address, while the connection stays on the vetted address."""
    try:
        # The handshake is started by hand so that the handle holds the TLS socket while it runs.
        tls = _tls_context().wrap_socket(
            raw, server_hostname=target.host, do_handshake_on_connect=False
        )
    except BaseException:
        handle._release(raw)
        raise
    handle._hold(tls)  # `raw` was detached into `tls`: the handle must shut down the live one
    try:
        tls.settimeout(_remaining(deadline, target))  # bounds the whole handshake, not one read
        tls.do_handshake()
    except TimeoutError:
        handle._release(tls)
        raise FetchTimeout(f"TLS with {target.shown} timed out") from None
    except (ssl.SSLError, ssl.CertificateError) as exc:
        handle._release(tls)
        raise FetchFailed(f"TLS with {target.shown} failed: {exc}") from None
    except OSError as exc:
        handle._release(tls)
        raise FetchFailed(f"TLS with {target.shown} failed: {exc!r}") from None
    except BaseException:
        handle._release(tls)
        raise
    return tls


def _open_socket(address: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return socket.socket(family, socket.SOCK_STREAM)


def _sockaddr(
    address: str, port: int
) -> tuple[str, int] | tuple[str, int, int, int] | tuple[int, bytes]:
    """The address exactly as vetted. AI_NUMERICHOST: a literal only, so nothing asks DNS again
    between the check and the connection; it also carries an IPv6 zone into the scope id."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    infos = socket.getaddrinfo(address, port, family, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    return infos[0][4]


def _remaining(deadline: float, target: _Target) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchTimeout(f"fetching {target.shown} ran past the time limit")
    return left


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    """Default verification; a seam for tests that trust a throwaway CA."""
    return ssl.create_default_context()
