"""The address policy (built-in special-purpose table, allow_private_networks, deny_networks,
allow_networks) and malformed URIs. No traffic leaves 127.0.0.1: other addresses only ever reach
`check_allowed` or a stubbed resolver, and a refused address is never connected to."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv6Address, ip_network

import pytest
from mmworker_preprocess import fetch, netpolicy
from mmworker_preprocess.errors import FetchFailed, ForbiddenUri, MalformedUri
from mmworker_preprocess.fetch import check_allowed, fetch_bytes, forbidden_reason
from mmworker_preprocess.params import FetchPolicy
from mmworker_schemas.codes import ErrorCode
from mmworker_schemas.job import MediaRef


def _nat64_local(v4: str, cut: int) -> str:
    """`v4` inside 64:ff9b:1::/48 as RFC 6052 §2.2 lays it out for a /`cut` prefix."""
    n, prefix = int(IPv4Address(v4)), int(IPv6Address("64:ff9b:1::"))
    if cut == 48:
        value = prefix | (n >> 16) << 64 | (n & 0xFFFF) << 40
    elif cut == 56:
        value = prefix | (n >> 24) << 64 | (n & 0xFFFFFF) << 32
    elif cut == 64:
        value = prefix | n << 24
    else:
        value = prefix | n
    return str(IPv6Address(value))


#: One address from each IANA special-purpose block (and the embeddings that lead into one).
SPECIAL = {
    "0.1.2.3": "unspecified",
    "10.255.0.1": "private",
    "100.64.0.1": "non-global",
    "127.8.9.10": "loopback",
    "169.254.1.1": "link-local",
    "169.254.169.254": "cloud-metadata",  # tests/unit/test_fetch_cloud_endpoints.py: the rest
    "172.31.255.255": "private",
    "192.0.0.8": "protocol-assignment",
    "192.0.0.170": "protocol-assignment",  # NAT64 discovery: global on some Python releases
    "192.0.2.10": "documentation",
    "192.31.196.1": "as112",
    "192.52.193.1": "amt",
    "192.88.99.1": "6to4-relay",
    "192.168.0.1": "private",
    "192.175.48.1": "as112",
    "198.19.255.1": "benchmarking",
    "198.51.100.7": "documentation",
    "203.0.113.9": "documentation",
    "239.255.255.250": "multicast",
    "241.0.0.1": "reserved",
    "255.255.255.255": "broadcast",
    "::": "unspecified",
    "::1": "loopback",
    "::8.8.8.8": "reserved",  # deprecated IPv4-compatible form
    "::ffff:10.0.0.1": "private",
    "::ffff:0:8.8.8.8": "reserved",  # SIIT, not the mapped prefix
    "64:ff9b::7f00:1": "loopback",
    _nat64_local("10.0.0.1", 48): "private",
    _nat64_local("10.0.0.1", 56): "private",
    _nat64_local("169.254.169.254", 64): "cloud-metadata",
    _nat64_local("127.0.0.1", 96): "loopback",
    "64:ff9b:1::": "unspecified",
    "100::1": "discard-only",
    "2001::1": "protocol-assignment",  # Teredo
    "2001:2::1": "protocol-assignment",  # benchmarking
    "2001:20::1": "protocol-assignment",  # ORCHIDv2
    "2001:db8::1": "documentation",
    "2002:a9fe:a9fe::1": "cloud-metadata",  # 6to4 of the metadata address
    "2620:4f:8000::1": "as112",
    "3fff::1": "documentation",
    "4000::1": "reserved",
    "fc00::1": "private",
    "fe80::1": "link-local",
    "fec0::1": "site-local",
    "feff::1": "site-local",
    "fe00::1": "reserved",
    "ff05::2": "multicast",
}


@pytest.mark.parametrize(("address", "label"), SPECIAL.items())
def test_every_special_purpose_block_is_refused_by_default(address, label, monkeypatch):
    assert forbidden_reason(address) == label
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: [address])
    with pytest.raises(ForbiddenUri, match=label) as info:
        check_allowed(MediaRef(uri="http://media.test/a.png"), FetchPolicy())
    assert not info.value.retryable


PUBLIC = [
    "1.1.1.1",
    "8.8.8.8",
    "192.0.1.1",
    "198.20.0.1",
    "2606:4700:4700::1111",
    "::ffff:8.8.8.8",
    "64:ff9b::808:808",
    "2002:808:808::1",
    "64:ff9b:1:808:8:808:808:808",  # 8.8.8.8 under every local-use NAT64 cut
    "64:ff9b:1::808:808",  # the usual /96 layout of local-use NAT64 (DNS64)
]


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_and_their_embeddings_are_allowed(address):
    assert forbidden_reason(address) is None


def test_every_reading_of_a_local_use_nat64_address_must_pass():
    # 8.8.8.x under the /48, /56 and /64 cuts; 10.0.0.1 under the /96 one.
    address = "64:ff9b:1:808:8:808:a00:1"
    assert netpolicy.embedded_ipv4(IPv6Address(address)) == (
        IPv4Address("8.8.8.8"),
        IPv4Address("8.8.8.10"),
        IPv4Address("10.0.0.1"),
    )
    assert forbidden_reason(address) == "private"


def test_the_table_not_the_python_flags_decides(monkeypatch):
    """Python's own flags are not consulted: making every address "global" changes nothing."""
    import ipaddress

    for cls in (ipaddress.IPv4Address, ipaddress.IPv6Address):
        for flag in ("is_private", "is_reserved", "is_link_local", "is_loopback"):
            monkeypatch.setattr(cls, flag, property(lambda self: False))
        monkeypatch.setattr(cls, "is_global", property(lambda self: True))
    assert forbidden_reason("192.0.0.170") == "protocol-assignment"
    assert forbidden_reason("fec0::1") == "site-local"
    assert forbidden_reason("127.0.0.1") == "loopback"


# --- the operator's switches -------------------------------------------------------------------


def _check(addresses: list[str], policy: FetchPolicy, monkeypatch) -> None:
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: addresses)
    check_allowed(MediaRef(uri="http://media.test/a.png"), policy)


PRIVATE = FetchPolicy(allow_private_networks=True)


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.1.1", "100.64.0.1",
     "::1", "fd00::1", "fe80::1", "fec0::1", "::ffff:192.168.1.1"],
)  # fmt: skip
def test_allow_private_networks_opens_loopback_private_and_link_local(address, monkeypatch):
    _check([address], PRIVATE, monkeypatch)


@pytest.mark.parametrize(
    "address",
    ["0.0.0.0", "224.0.0.1", "255.255.255.255", "192.0.2.1", "198.18.0.1", "240.0.0.1",
     "192.0.0.170", "ff02::1", "2001:db8::1", "2001::1", "::"],
)  # fmt: skip
def test_allow_private_networks_does_not_open_the_other_special_blocks(address, monkeypatch):
    with pytest.raises(ForbiddenUri):
        _check([address], PRIVATE, monkeypatch)


def _deny(*cidrs: str, **kw: object) -> FetchPolicy:
    return FetchPolicy(deny_networks=tuple(ip_network(c) for c in cidrs), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "address",
    ["1.1.1.1", "::ffff:1.1.1.1", "64:ff9b::101:101", "2002:101:101::1"],
)
def test_deny_networks_refuses_public_space_in_every_form(address, monkeypatch):
    _check([address], FetchPolicy(), monkeypatch)  # public: allowed without the deny list
    with pytest.raises(ForbiddenUri, match=r"1\.1\.1\.1/32.*deny_networks"):
        _check([address], _deny("1.1.1.1/32"), monkeypatch)


def test_deny_networks_wins_over_both_allow_switches(monkeypatch):
    policy = _deny(
        "10.1.2.0/28",
        allow_private_networks=True,
        allow_networks=(ip_network("10.1.2.0/24"),),
    )
    _check(["10.1.2.200"], policy, monkeypatch)
    with pytest.raises(ForbiddenUri, match="deny_networks"):
        _check(["10.1.2.3"], policy, monkeypatch)


def test_allow_networks_opens_only_its_blocks_and_every_address_must_pass(monkeypatch):
    policy = FetchPolicy(allow_networks=(ip_network("10.1.2.0/24"), ip_network("fd12::/16")))
    _check(["10.1.2.3", "fd12::5", "::ffff:10.1.2.4"], policy, monkeypatch)
    for other in ("10.1.3.1", "127.0.0.1", "fd13::1"):
        with pytest.raises(ForbiddenUri, match=other.replace(".", r"\.")):
            _check(["10.1.2.3", other], policy, monkeypatch)


# --- against a real local server: a refused address is never connected to ----------------------


@pytest.fixture
def server() -> Iterator[tuple[int, list[int]]]:
    """A server on 127.0.0.1 answering one fixed response; the list counts connections."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    accepted: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            with conn:
                conn.settimeout(2)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(4096) or b"\r\n\r\n"
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\ndata")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield listener.getsockname()[1], accepted
    stop.set()
    thread.join(2)
    listener.close()


def test_deny_networks_beats_allow_private_networks_for_real(server):
    port, accepted = server
    ref = MediaRef(uri=f"http://127.0.0.1:{port}/a.png")
    assert fetch_bytes(ref, FetchPolicy(allow_private_networks=True)) == b"data"
    with pytest.raises(ForbiddenUri, match="deny_networks"):
        fetch_bytes(ref, _deny("127.0.0.0/8", allow_private_networks=True))
    assert len(accepted) == 1, "the denied fetch must not connect"


def test_allow_networks_opens_the_loopback_server_without_allow_private(server):
    port, accepted = server
    ref = MediaRef(uri=f"http://127.0.0.1:{port}/a.png")
    with pytest.raises(ForbiddenUri, match="loopback"):
        fetch_bytes(ref, FetchPolicy(allow_networks=(ip_network("127.0.0.2/32"),)))
    assert not accepted
    assert fetch_bytes(ref, FetchPolicy(allow_networks=(ip_network("127.0.0.1/32"),))) == b"data"


# --- malformed URIs -----------------------------------------------------------------------------

MALFORMED = [
    "http://[::1/x",
    "http://[evil.test]/",
    "http://[v1.future]/",
    "http://[fe80::1%25eth0]/a.png",
    "http://ex ample.test/a.png",
    "http://" + "a" * 64 + ".test/a.png",
    "http://" + ".".join(["abcdefghi"] * 26) + "/a.png",  # 259 characters
    "http://a..test/",
    "http://.test/",
    "http://bad!host.test/",
    "http://ex%41mple.test/",
    "http://1.2.3.4.5/",
    "http://999.1.1.1/",
    "http://host.test:0/",
    "http://host.test:99999/",
    "http://host.test:8o/",
    "http:///a.png",
    "http://\udcff.test/",
]


@pytest.mark.parametrize("uri", MALFORMED)
def test_a_malformed_uri_is_a_permanent_typed_failure_and_resolves_nothing(uri, monkeypatch):
    asked: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        raise AssertionError(f"{host!r} reached the resolver")

    monkeypatch.setattr(fetch, "_resolve", resolve)
    ref = MediaRef.model_construct(uri=uri, data=None, sha256=None)
    for call in (
        lambda: fetch_bytes(ref, FetchPolicy()),
        lambda: check_allowed(ref, FetchPolicy()),
    ):
        with pytest.raises(MalformedUri) as info:
            call()
        assert info.value.code is ErrorCode.FORBIDDEN_URI
        assert not info.value.retryable
    assert asked == []


def test_unusual_but_valid_hosts_are_resolved_in_ascii(monkeypatch):
    asked: list[str] = []
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: asked.append(host) or ["1.1.1.1"])
    for uri in (
        "http://B\u00fccher.Example/a.png",
        "http://media.example./a.png",
        "http://under_score.example/a.png",
        "http://127.1/a.png",
        "http://[::FFFF:1.1.1.1]/a.png",
    ):
        check_allowed(MediaRef(uri=uri), FetchPolicy())
    assert asked == [
        "xn--bcher-kva.example",
        "media.example.",
        "under_score.example",
        "127.1",
        "::ffff:101:101",
    ]


def test_a_resolver_answer_that_is_not_an_address_is_permanent(monkeypatch):
    monkeypatch.setattr(fetch, "_resolve", lambda host, port: ["not-an-ip"])
    with pytest.raises(FetchFailed, match="not an IP address") as info:
        check_allowed(MediaRef(uri="http://media.test/a.png"), FetchPolicy())
    assert not info.value.retryable


@pytest.mark.parametrize("uri", ["file://[/tmp/a.png", "file://[::1/tmp/a.png"])
def test_a_malformed_file_uri_is_a_typed_failure_too(uri: str, tmp_path) -> None:
    """urlsplit raises ValueError for an unclosed bracket: it was an internal_error."""
    ref = MediaRef.model_construct(uri=uri, data=None, sha256=None)
    policy = FetchPolicy(allowed_roots=(tmp_path,))
    for call in (lambda: fetch_bytes(ref, policy), lambda: check_allowed(ref, policy)):
        with pytest.raises(MalformedUri) as info:
            call()
        assert info.value.code is ErrorCode.FORBIDDEN_URI


def test_a_socket_that_cannot_be_created_is_a_fetch_failure(monkeypatch) -> None:
    """EMFILE, or an IPv6 address on a host without IPv6: a bare OSError was internal_error."""
    import errno

    def no_socket(address: str):  # type: ignore[no-untyped-def]
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(fetch, "_resolve", lambda host, port: ["93.184.216.34"])
    monkeypatch.setattr(fetch, "_open_socket", no_socket)
    ref = MediaRef(uri="http://media.test/a.png")
    with pytest.raises(FetchFailed, match="Too many open files"):
        fetch_bytes(ref, FetchPolicy())
