"""Fetch the bytes behind a `MediaRef` without letting a job read or reach what it should not.

URIs come from producers, so every fetch is treated as untrusted input: file:// is confined to
configured roots, and http(s):// refuses internal addresses (cloud metadata, loopback admin ports,
the private network) unless the operator opts in. Sizes and time are bounded because one slow or
huge download must not stall a worker that serves many jobs.

Synchronous by design: it runs in a thread or process pool next to decoding.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import http.client
import ipaddress
import os
import socket
import ssl
import stat
import time
from dataclasses import dataclass
from urllib.parse import quote, unquote, urljoin, urlsplit

from preprocess.errors import (
    ChecksumMismatch,
    FetchFailed,
    FetchTimeout,
    ForbiddenUri,
    TooLarge,
)
from preprocess.params import FetchPolicy
from schemas.job import MediaRef

_CHUNK = 64 * 1024
_URL_SAFE = "/%:@!$&'()*+,;=?"
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_HEADERS = {
    "User-Agent": "mmworker-fetch/1",
    "Accept": "image/*, video/*;q=0.9, */*;q=0.5",
    # Compressed transfer would hide the real size from the byte limit, and media rarely shrinks.
    "Accept-Encoding": "identity",
    "Connection": "close",
}
#: NAT64 embeds an IPv4 address in the low 32 bits; it must be judged as that IPv4 address.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch_bytes(ref: MediaRef, policy: FetchPolicy) -> bytes:
    """Return the media bytes of `ref`, verified against `ref.sha256` when it is given."""
    if ref.data is not None:
        data = ref.data
        if len(data) > policy.max_bytes:
            raise TooLarge(f"inline media is {len(data)} bytes; the limit is {policy.max_bytes}")
    elif ref.uri is not None and ref.uri.startswith("file://"):
        data = _read_file(ref.uri, policy)
    elif ref.uri is not None:
        data = _fetch_http(ref.uri, policy)
    else:  # pragma: no cover - MediaRef's validator guarantees one source
        raise ForbiddenUri("media ref has neither uri nor data")
    if ref.sha256 is not None:
        actual = sha256_hex(data)
        if actual != ref.sha256:
            raise ChecksumMismatch(f"sha256 of the media is {actual}; expected {ref.sha256}")
    return data


def check_allowed(ref: MediaRef, policy: FetchPolicy) -> None:
    """Raise what fetching `ref` would raise for its address alone, without reading anything.

    For a cache hit found by a declared sha256, which skips the fetch: the job must still be one
    this worker would have fetched (a forbidden URI stays forbidden when its content is cached).
    """
    if ref.uri is None:
        return
    if ref.uri.startswith("file://"):
        _checked_path(ref.uri, policy)
    else:
        _vetted_addresses(_parse_http(ref.uri), policy)


# --- file:// ---------------------------------------------------------------------------------


def _checked_path(uri: str, policy: FetchPolicy) -> tuple[str, str]:
    """(path as given, real path inside an allowed root), or ForbiddenUri."""
    if not policy.allowed_roots:
        raise ForbiddenUri("file:// URIs are disabled: the worker has no allowed roots configured")
    parts = urlsplit(uri)
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
    host: str
    port: int
    path: str  # path and query, as sent in the request line
    shown: str  # the URL without userinfo or query: signed URLs carry secrets in the query


def _fetch_http(uri: str, policy: FetchPolicy) -> bytes:
    """GET `uri`, following redirects by hand so that every hop's address is vetted."""
    deadline = time.monotonic() + policy.timeout_s
    url = uri
    for _ in range(policy.max_redirects + 1):
        target = _parse_http(url)
        addresses = _vetted_addresses(target, policy)
        location = _get(target, addresses, policy, deadline)
        if isinstance(location, bytes):
            return location
        url = urljoin(url, location)
    raise FetchFailed(
        f"more than {policy.max_redirects} redirects fetching {_parse_http(uri).shown}"
    )


def _parse_http(url: str) -> _Target:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ForbiddenUri(f"redirect to a {scheme or 'relative'}:// URI is not allowed")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise ForbiddenUri(f"URI has an invalid port: {url[:200]!r}") from None
    host = parts.hostname
    if not host:
        raise ForbiddenUri(f"URI has no host: {url[:200]!r}")
    if parts.username is not None or parts.password is not None:
        raise ForbiddenUri("credentials in URIs are not supported")
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{port}"
    # Percent-encode what http.client would refuse (spaces, non-ASCII); keep existing escapes.
    path = quote((parts.path or "/") + (f"?{parts.query}" if parts.query else ""), safe=_URL_SAFE)
    return _Target(scheme, host, port, path, f"{scheme}://{netloc}{parts.path or '/'}")


def _resolve(host: str, port: int) -> list[str]:
    """All addresses of `host`; a seam for tests, which point made-up names at a local server."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _vetted_addresses(target: _Target, policy: FetchPolicy) -> list[str]:
    """Resolve once and check every address; the connection then uses these, never a new lookup.

    Checking one lookup and connecting through another would let a DNS answer change in between
    (DNS rebinding). Any forbidden address fails the whole host, since a name that mixes public
    and internal addresses is either misconfigured or an attack.
    """
    try:
        addresses = _resolve(target.host, target.port)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchFailed(f"cannot resolve {target.host}: {exc}") from None
    if not addresses:
        raise FetchFailed(f"{target.host} has no addresses")
    if not policy.allow_private_networks:
        for address in addresses:
            reason = forbidden_reason(address)
            if reason is not None:
                raise ForbiddenUri(
                    f"{target.shown} resolves to {address}, a {reason} address; "
                    "internal networks are not reachable from jobs"
                )
    return addresses


def forbidden_reason(address: str) -> str | None:
    """Why `address` must not be fetched from by default, or None when it is public."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return forbidden_reason(str(embedded))
    checks = (
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),  # 169.254.169.254 cloud metadata lives here
        ("unspecified", ip.is_unspecified),
        ("multicast", ip.is_multicast),
        ("reserved", ip.is_reserved),
        ("private", ip.is_private),
        ("non-global", not ip.is_global),  # e.g. 100.64.0.0/10 carrier NAT, some metadata
    )
    return next((label for label, hit in checks if hit), None)


def _get(
    target: _Target, addresses: list[str], policy: FetchPolicy, deadline: float
) -> bytes | str:
    """One request: the body, or the Location of a redirect to follow."""
    remaining = _remaining(deadline, target)
    conn = _connect(target, addresses, remaining)
    # Kept apart from `conn`: http.client drops conn.sock once the response owns the stream.
    sock: socket.socket = conn.sock
    try:
        conn.request("GET", target.path, headers=_HEADERS)
        response = conn.getresponse()
        status = response.status
        if status in _REDIRECTS:
            location = response.getheader("Location")
            if not location:
                raise FetchFailed(f"HTTP {status} from {target.shown} without a Location")
            return location
        if status != 200:
            kind = "server error" if status >= 500 else "refused"
            raise FetchFailed(f"HTTP {status} {response.reason} ({kind}) from {target.shown}")
        return _read_body(response, sock, policy.max_bytes, deadline, target)
    except TimeoutError:
        raise FetchTimeout(
            f"no complete response from {target.shown} within the time limit"
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise FetchFailed(f"fetching {target.shown} failed: {exc!r}") from None
    finally:
        conn.close()


def _connect(target: _Target, addresses: list[str], timeout: float) -> _PinnedConnection:
    """Connect to the first vetted address that answers."""
    last: OSError | None = None
    for address in addresses:
        conn: _PinnedConnection
        if target.scheme == "https":
            conn = _PinnedHTTPSConnection(
                target.host, target.port, address, timeout, _tls_context()
            )
        else:
            conn = _PinnedHTTPConnection(target.host, target.port, address, timeout)
        try:
            conn.connect()
        except TimeoutError:
            raise FetchTimeout(f"connecting to {target.shown} timed out") from None
        except ssl.SSLError as exc:
            raise FetchFailed(f"TLS with {target.shown} failed: {exc}") from None
        except OSError as exc:
            last = exc
            continue
        return conn
    raise FetchFailed(f"cannot connect to {target.shown}: {last}")


def _read_body(
    response: http.client.HTTPResponse,
    sock: socket.socket,
    max_bytes: int,
    deadline: float,
    target: _Target,
) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise TooLarge(f"{target.shown} declares {int(declared)} bytes; the limit is {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    while True:
        # The socket timeout bounds one read; re-arming it with what is left of the deadline
        # also bounds a server that drips a byte at a time.
        sock.settimeout(_remaining(deadline, target))
        chunk = response.read1(_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > max_bytes:
            raise TooLarge(f"{target.shown} sent more than the limit of {max_bytes} bytes")
        chunks.append(chunk)
    if response.length:  # Content-Length promised more than arrived
        raise FetchFailed(f"{target.shown} closed the connection {response.length} bytes early")
    return b"".join(chunks)


def _remaining(deadline: float, target: _Target) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchTimeout(f"fetching {target.shown} ran past the time limit")
    return left


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    """Default verification; a seam for tests that trust a throwaway CA."""
    return ssl.create_default_context()


def _open_socket(address: str, port: int, timeout: float | None) -> socket.socket:
    return socket.create_connection((address, port), timeout)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the vetted address while the Host header still names the requested server."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = _open_socket(self.address, self.port, self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """As `_PinnedHTTPConnection`; SNI and certificate checks use the hostname, not the address."""

    def __init__(
        self, host: str, port: int, address: str, timeout: float, context: ssl.SSLContext
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.address = address
        self.tls = context

    def connect(self) -> None:
        raw = _open_socket(self.address, self.port, self.timeout)
        try:
            self.sock = self.tls.wrap_socket(raw, server_hostname=self.host)
        except BaseException:
            raw.close()
            raise


_PinnedConnection = _PinnedHTTPConnection | _PinnedHTTPSConnection
