from __future__ import annotations

import datetime as dt
import http.server
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mmworker_preprocess import fetch
from mmworker_preprocess.errors import (
    ChecksumMismatch,
    FetchAborted,
    FetchFailed,
    FetchTimeout,
    ForbiddenUri,
    TooLarge,
)
from mmworker_preprocess.fetch import check_allowed, fetch_bytes, forbidden_reason, sha256_hex
from mmworker_preprocess.params import FetchPolicy
from mmworker_schemas.codes import ErrorCode
from mmworker_schemas.job import MediaRef

BODY = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8


def _ref(uri: str, sha256: str | None = None) -> MediaRef:
    return MediaRef(uri=uri, sha256=sha256)


# --- inline data ------------------------------------------------------------------------------


def test_inline_data_is_returned_and_checked():
    assert fetch_bytes(MediaRef(data=BODY), FetchPolicy()) == BODY
    assert fetch_bytes(MediaRef(data=BODY, sha256=sha256_hex(BODY)), FetchPolicy()) == BODY
    with pytest.raises(ChecksumMismatch) as info:
        fetch_bytes(MediaRef(data=BODY, sha256="0" * 64), FetchPolicy())
    assert info.value.code is ErrorCode.CHECKSUM_MISMATCH and not info.value.retryable


def test_inline_data_over_the_limit_is_too_large():
    with pytest.raises(TooLarge):
        fetch_bytes(MediaRef(data=BODY), FetchPolicy(max_bytes=len(BODY) - 1))
    assert fetch_bytes(MediaRef(data=BODY), FetchPolicy(max_bytes=len(BODY))) == BODY


def test_sha256_hex_is_lowercase_hex():
    assert sha256_hex(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


# --- file:// ----------------------------------------------------------------------------------


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(BODY)
    (root / "sub").mkdir()
    (root / "sub" / "with space.png").write_bytes(BODY)
    (tmp_path / "secret.txt").write_bytes(b"outside the root")
    return root


def _policy(root: Path, **kw) -> FetchPolicy:
    return FetchPolicy(allowed_roots=(root,), **kw)


def test_file_inside_root_is_read(media_root):
    assert fetch_bytes(_ref(f"file://{media_root}/a.png"), _policy(media_root)) == BODY
    uri = f"file://localhost{media_root}/sub/with%20space.png"
    assert fetch_bytes(_ref(uri), _policy(media_root)) == BODY


def test_file_uris_are_off_without_roots(media_root):
    with pytest.raises(ForbiddenUri, match="no allowed roots"):
        fetch_bytes(_ref(f"file://{media_root}/a.png"), FetchPolicy())


@pytest.mark.parametrize(
    "suffix",
    ["/../secret.txt", "/sub/../../secret.txt", "/%2e%2e/secret.txt"],
)
def test_dotdot_cannot_escape_the_root(media_root, suffix):
    with pytest.raises(ForbiddenUri, match="outside the allowed roots"):
        fetch_bytes(_ref(f"file://{media_root}{suffix}"), _policy(media_root))


def test_sibling_with_root_as_prefix_is_outside(media_root):
    evil = media_root.parent / (media_root.name + "-evil")
    evil.mkdir()
    (evil / "x.png").write_bytes(BODY)
    with pytest.raises(ForbiddenUri):
        fetch_bytes(_ref(f"file://{evil}/x.png"), _policy(media_root))


def test_symlink_out_of_the_root_is_refused(media_root):
    (media_root / "link.png").symlink_to(media_root.parent / "secret.txt")
    (media_root / "dirlink").symlink_to(media_root.parent)
    with pytest.raises(ForbiddenUri):
        fetch_bytes(_ref(f"file://{media_root}/link.png"), _policy(media_root))
    with pytest.raises(ForbiddenUri):
        fetch_bytes(_ref(f"file://{media_root}/dirlink/secret.txt"), _policy(media_root))


def test_parent_swapped_after_the_check_is_caught_after_open(media_root, monkeypatch):
    """The window O_NOFOLLOW cannot close: a parent directory replaced by a symlink between the
    containment check and the open. Simulated by a check that passed on what is now outside."""
    outside = str(media_root.parent / "secret.txt")
    monkeypatch.setattr(fetch, "_checked_path", lambda uri, policy: (uri, outside))
    with pytest.raises(ForbiddenUri, match="moved outside the allowed roots"):
        fetch_bytes(_ref(f"file://{media_root}/a.png"), _policy(media_root))


def test_check_allowed_applies_the_address_rules_without_reading(media_root):
    policy = _policy(media_root)
    check_allowed(_ref(f"file://{media_root}/not-there-yet.png"), policy)  # nothing is opened
    check_allowed(MediaRef(data=b"inline"), policy)
    with pytest.raises(ForbiddenUri, match="outside the allowed roots"):
        check_allowed(_ref(f"file://{media_root}/../secret.txt"), policy)
    with pytest.raises(ForbiddenUri, match="loopback"):
        check_allowed(_ref("http://127.0.0.1:9/a.png"), policy)


def test_symlink_within_the_root_and_symlinked_root_are_fine(media_root, tmp_path):
    (media_root / "alias.png").symlink_to(media_root / "a.png")
    assert fetch_bytes(_ref(f"file://{media_root}/alias.png"), _policy(media_root)) == BODY
    linked_root = tmp_path / "linked-root"
    linked_root.symlink_to(media_root)
    assert fetch_bytes(_ref(f"file://{media_root}/a.png"), _policy(linked_root)) == BODY


def test_file_uri_with_a_host_is_refused(media_root):
    with pytest.raises(ForbiddenUri, match="host"):
        fetch_bytes(_ref(f"file://fileserver{media_root}/a.png"), _policy(media_root))


def test_missing_file_fails(media_root):
    with pytest.raises(FetchFailed, match="no such file"):
        fetch_bytes(_ref(f"file://{media_root}/nope.png"), _policy(media_root))


def test_directory_and_fifo_are_not_regular_files(media_root):
    with pytest.raises(ForbiddenUri, match="regular file"):
        fetch_bytes(_ref(f"file://{media_root}/sub"), _policy(media_root))
    os.mkfifo(media_root / "pipe")
    with pytest.raises(ForbiddenUri, match="regular file"):  # and it must not block
        fetch_bytes(_ref(f"file://{media_root}/pipe"), _policy(media_root))


def test_file_over_the_limit_is_too_large(media_root):
    with pytest.raises(TooLarge):
        fetch_bytes(_ref(f"file://{media_root}/a.png"), _policy(media_root, max_bytes=100))


def test_file_checksum_is_verified(media_root):
    uri = f"file://{media_root}/a.png"
    assert fetch_bytes(_ref(uri, sha256_hex(BODY)), _policy(media_root)) == BODY
    with pytest.raises(ChecksumMismatch, match=sha256_hex(BODY)):
        fetch_bytes(_ref(uri, "ab" * 32), _policy(media_root))


# --- address policy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "cloud-metadata"),
        ("100.100.100.200", "cloud-metadata"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("::1", "loopback"),
        ("fe80::1%eth0", "link-local"),
        ("fd00:ec2::254", "cloud-metadata"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "cloud-metadata"),
        ("64:ff9b::a9fe:a9fe", "cloud-metadata"),
        ("2002:7f00:1::", "loopback"),
        ("ff02::1", "multicast"),
    ],
)
def test_internal_addresses_are_forbidden(address, reason):
    assert forbidden_reason(address) == reason


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address):
    assert forbidden_reason(address) is None


def test_a_name_with_any_internal_address_is_refused(monkeypatch):
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: ["8.8.8.8", "10.0.0.5"])
    with pytest.raises(ForbiddenUri, match=r"10\.0\.0\.5"):
        fetch_bytes(_ref("http://mixed.example/a.png"), FetchPolicy())


@pytest.fixture
def hung_resolver(monkeypatch) -> Iterator[threading.Event]:
    """A name server that does not answer: getaddrinfo waits out its own timeouts and retries."""
    answer = threading.Event()

    def resolve(host, port):
        if not host.startswith("slow"):
            return [host]  # an address literal: no name server is asked
        answer.wait(30)
        return ["93.184.216.34"]

    monkeypatch.setattr(fetch, "_resolve", resolve)
    yield answer
    answer.set()  # lets the lookups left behind end


def test_a_lookup_that_hangs_is_bounded_by_the_fetch_deadline(hung_resolver):
    started = time.monotonic()
    with pytest.raises(FetchTimeout, match=r"no DNS answer for slow\.example") as info:
        fetch_bytes(_ref("http://slow.example/a.png"), FetchPolicy(timeout_s=0.5))
    assert info.value.retryable
    assert time.monotonic() - started < 3  # not the resolver's 30 s
    # The check a cache hit makes by a declared hash is bounded alike.
    started = time.monotonic()
    with pytest.raises(FetchTimeout):
        check_allowed(_ref("http://slow.example/a.png", "0" * 64), FetchPolicy(timeout_s=0.5))
    assert time.monotonic() - started < 3


def test_a_job_stops_its_fetch_while_the_lookup_hangs(hung_resolver):
    handle = fetch.FetchHandle()
    threading.Timer(0.3, handle.abort).start()
    started = time.monotonic()
    with pytest.raises(FetchAborted):
        fetch_bytes(_ref("http://slow.example/a.png"), FetchPolicy(timeout_s=20), handle)
    assert time.monotonic() - started < 3


def test_lookups_that_hang_take_no_slot_from_address_literals_or_stopped_fetches(
    hung_resolver, monkeypatch
):
    monkeypatch.setattr(fetch, "_LOOKUPS", threading.BoundedSemaphore(1))
    with pytest.raises(FetchTimeout):
        fetch_bytes(_ref("http://slow1.example/a"), FetchPolicy(timeout_s=0.3))
    # That fetch gave up; its lookup still holds the only slot.
    # An address literal asks no name server, so it needs no slot.
    with pytest.raises(ForbiddenUri):
        check_allowed(_ref("http://10.0.0.5/a.png", "0" * 64), FetchPolicy(timeout_s=0.3))
    # A fetch waiting for a slot is stopped by its job, and times out at its deadline.
    handle = fetch.FetchHandle()
    threading.Timer(0.3, handle.abort).start()
    started = time.monotonic()
    with pytest.raises(FetchAborted):
        fetch_bytes(_ref("http://slow2.example/a"), FetchPolicy(timeout_s=20), handle)
    assert time.monotonic() - started < 3
    with pytest.raises(FetchTimeout, match="past the time limit"):
        fetch_bytes(_ref("http://slow3.example/a"), FetchPolicy(timeout_s=0.3))
    # The slot comes back once the lookup ends.
    hung_resolver.set()
    assert fetch._LOOKUPS.acquire(timeout=5)


def test_a_lookup_left_behind_gives_its_slot_back_where_it_took_it(hung_resolver, monkeypatch):
    """Its thread released whatever semaphore the module held when the lookup ended: a test that
    had swapped in a full one saw "Semaphore released too many times" raised in that thread."""
    taken_from = threading.BoundedSemaphore(1)
    monkeypatch.setattr(fetch, "_LOOKUPS", taken_from)
    with pytest.raises(FetchTimeout):
        fetch_bytes(_ref("http://slow.example/a"), FetchPolicy(timeout_s=0.3))
    full = threading.BoundedSemaphore(1)
    monkeypatch.setattr(fetch, "_LOOKUPS", full)
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    lookups = [t for t in threading.enumerate() if t.name == "mmworker-dns"]
    hung_resolver.set()
    for thread in lookups:
        thread.join(5)
    assert errors == []
    assert taken_from.acquire(timeout=0)  # its slot came back
    assert full.acquire(timeout=0) and not full.acquire(timeout=0)  # and this one is unchanged


def test_unresolvable_host_fails_retryably(monkeypatch):
    def fail(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(fetch, "_resolve", fail)
    with pytest.raises(FetchFailed, match="cannot resolve") as info:
        fetch_bytes(_ref("http://nowhere.invalid/a.png"), FetchPolicy())
    assert info.value.retryable


def test_credentials_in_uri_are_refused():
    with pytest.raises(ForbiddenUri, match="credentials"):
        fetch_bytes(_ref("http://user:pw@example.com/a.png"), FetchPolicy())


# --- http:// against a local server ------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # keep test output quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None):
        self.send_response(status)
        for key, value in (headers or {"Content-Length": str(len(body))}).items():
            self.send_header(key, value)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path in ("/img.png", "/with%20space.png"):
            self._send(200, BODY)
        elif path == "/host":
            self._send(200, self.headers["Host"].encode())
        elif path == "/redirect":
            self._send(302, headers={"Location": "/img.png", "Content-Length": "0"})
        elif path == "/redirect-chain":
            self._send(301, headers={"Location": "/redirect", "Content-Length": "0"})
        elif path == "/redirect-loop":
            self._send(302, headers={"Location": "/redirect-loop", "Content-Length": "0"})
        elif path == "/redirect-metadata":
            target = "http://169.254.169.254/latest/meta-data/"
            self._send(307, headers={"Location": target, "Content-Length": "0"})
        elif path == "/redirect-file":
            self._send(302, headers={"Location": "file:///etc/passwd", "Content-Length": "0"})
        elif path == "/slow":
            time.sleep(3)
            self._send(200, BODY)
        elif path == "/drip":
            self._send(200, headers={"Content-Length": "100"})
            for _ in range(100):
                time.sleep(0.05)
                self.wfile.write(b"x")
                self.wfile.flush()
        elif path == "/big-declared":
            self._send(200, b"tiny", headers={"Content-Length": "50000000"})
        elif path == "/big-stream":
            self._send(200, headers={"Transfer-Encoding": "chunked"})
            for _ in range(20):
                self.wfile.write(b"400\r\n" + b"y" * 1024 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/short":
            self._send(200, b"only ten b", headers={"Content-Length": "100"})
        elif path.startswith("/status/"):
            self._send(int(path.rsplit("/", 1)[1]), b"error page")
        else:
            self._send(404, b"not found")


def _serve(server: http.server.ThreadingHTTPServer) -> Iterator[int]:
    server.daemon_threads = True
    server.block_on_close = False
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def port() -> Iterator[int]:
    yield from _serve(http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler))


LOCAL = FetchPolicy(allow_private_networks=True, timeout_s=5.0)


def test_loopback_server_is_refused_by_default(port):
    for host in ("127.0.0.1", "localhost"):
        with pytest.raises(ForbiddenUri, match="loopback") as info:
            fetch_bytes(_ref(f"http://{host}:{port}/img.png"), FetchPolicy())
        assert not info.value.retryable


def test_loopback_server_is_fetched_when_private_networks_are_allowed(port):
    ref = _ref(f"http://127.0.0.1:{port}/img.png", sha256_hex(BODY))
    assert fetch_bytes(ref, LOCAL) == BODY


def test_http_checksum_mismatch(port):
    with pytest.raises(ChecksumMismatch):
        fetch_bytes(_ref(f"http://127.0.0.1:{port}/img.png", "cd" * 32), LOCAL)


def test_paths_are_percent_encoded(port):
    assert fetch_bytes(_ref(f"http://127.0.0.1:{port}/with space.png"), LOCAL) == BODY


def test_redirects_are_followed(port):
    assert fetch_bytes(_ref(f"http://127.0.0.1:{port}/redirect-chain"), LOCAL) == BODY


def test_redirect_limit(port):
    with pytest.raises(FetchFailed, match="more than 2 redirects"):
        fetch_bytes(
            _ref(f"http://127.0.0.1:{port}/redirect-loop"),
            FetchPolicy(allow_private_networks=True, max_redirects=2),
        )
    policy = FetchPolicy(allow_private_networks=True, max_redirects=1)
    with pytest.raises(FetchFailed, match="redirects"):
        fetch_bytes(_ref(f"http://127.0.0.1:{port}/redirect-chain"), policy)


@pytest.fixture
def only_local_server_allowed(monkeypatch):
    """Treat 127.0.0.1 as public so a redirect's *target* is what the policy judges."""
    real = fetch.forbidden_reason
    monkeypatch.setattr(fetch, "forbidden_reason", lambda a: None if a == "127.0.0.1" else real(a))


def test_redirect_to_metadata_address_is_refused(port, only_local_server_allowed):
    assert fetch_bytes(_ref(f"http://127.0.0.1:{port}/img.png"), FetchPolicy()) == BODY
    with pytest.raises(ForbiddenUri, match=r"169\.254\.169\.254.*cloud-metadata"):
        fetch_bytes(_ref(f"http://127.0.0.1:{port}/redirect-metadata"), FetchPolicy())


def test_redirect_to_file_uri_is_refused(port):
    with pytest.raises(ForbiddenUri, match="file://"):
        fetch_bytes(_ref(f"http://127.0.0.1:{port}/redirect-file"), LOCAL)


def test_connection_goes_to_the_vetted_address_with_the_original_host(port, monkeypatch):
    monkeypatch.setattr(fetch, "_resolve", lambda host, p: ["127.0.0.1"])
    asked: list[str] = []
    real_getaddrinfo = socket.getaddrinfo

    def spy(host, *args, **kwargs):
        asked.append(host)
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", spy)
    body = fetch_bytes(_ref(f"http://media.example:{port}/host"), LOCAL)
    assert body == f"media.example:{port}".encode()
    # No second lookup of the name: a rebinding DNS answer could not redirect the connection.
    assert "media.example" not in asked


def test_slow_server_times_out(port):
    started = time.monotonic()
    with pytest.raises(FetchTimeout) as info:
        fetch_bytes(
            _ref(f"http://127.0.0.1:{port}/slow"),
            FetchPolicy(allow_private_networks=True, timeout_s=0.5),
        )
    assert time.monotonic() - started < 2.0
    assert info.value.retryable


def test_dripping_server_hits_the_total_deadline(port):
    # Each byte arrives well within the per-read timeout; only a total deadline stops this.
    started = time.monotonic()
    with pytest.raises(FetchTimeout):
        fetch_bytes(
            _ref(f"http://127.0.0.1:{port}/drip"),
            FetchPolicy(allow_private_networks=True, timeout_s=0.8),
        )
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize(("status", "word"), [(404, "refused"), (403, "refused"), (503, "server")])
def test_error_statuses_fail_with_the_status(port, status, word):
    with pytest.raises(FetchFailed, match=f"HTTP {status}.*{word}") as info:
        fetch_bytes(_ref(f"http://127.0.0.1:{port}/status/{status}?sig=SECRET"), LOCAL)
    assert info.value.code is ErrorCode.FETCH_FAILED
    assert "SECRET" not in info.value.message, "signed query strings must not leak into errors"


def test_too_large_by_content_length(port):
    with pytest.raises(TooLarge, match="declares 50000000"):
        fetch_bytes(
            _ref(f"http://127.0.0.1:{port}/big-declared"),
            FetchPolicy(allow_private_networks=True, max_bytes=10_000),
        )


def test_too_large_while_streaming(port):
    with pytest.raises(TooLarge, match="more than"):
        fetch_bytes(
            _ref(f"http://127.0.0.1:{port}/big-stream"),
            FetchPolicy(allow_private_networks=True, max_bytes=10_000),
        )
    assert len(fetch_bytes(_ref(f"http://127.0.0.1:{port}/big-stream"), LOCAL)) == 20 * 1024


def test_body_shorter_than_content_length_fails(port):
    with pytest.raises(FetchFailed, match="early"):
        fetch_bytes(_ref(f"http://127.0.0.1:{port}/short"), LOCAL)


def test_connection_refused_fails_retryably():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        unused = sock.getsockname()[1]
    with pytest.raises(FetchFailed, match="cannot connect") as info:
        fetch_bytes(_ref(f"http://127.0.0.1:{unused}/img.png"), LOCAL)
    assert info.value.retryable


# --- https:// ---------------------------------------------------------------------------------


def _make_tls(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A throwaway CA and a certificate for media.test: (server context, client context)."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)

    def build(subject, issuer, public, signer, *, ca, san=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        )
        if san:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("test ca", "test ca", ca_key.public_key(), ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build("media.test", "test ca", key.public_key(), ca_key, ca=False, san="media.test")

    pem = serialization.Encoding.PEM
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(pem))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client = ssl.create_default_context(cadata=ca.public_bytes(pem).decode())
    return server, client


@pytest.fixture
def tls_port(tmp_path, monkeypatch) -> Iterator[int]:
    server_ctx, client_ctx = _make_tls(tmp_path)
    monkeypatch.setattr(fetch, "_tls_context", lambda: client_ctx)
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: ["127.0.0.1"])
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.socket = server_ctx.wrap_socket(httpd.socket, server_side=True)
    yield from _serve(httpd)


def test_https_verifies_the_hostname_while_connecting_to_the_vetted_address(tls_port):
    body = fetch_bytes(_ref(f"https://media.test:{tls_port}/host"), LOCAL)
    assert body == f"media.test:{tls_port}".encode()


def test_https_certificate_for_another_name_is_refused(tls_port):
    with pytest.raises(FetchFailed, match="TLS"):
        fetch_bytes(_ref(f"https://other.test:{tls_port}/img.png"), LOCAL)
