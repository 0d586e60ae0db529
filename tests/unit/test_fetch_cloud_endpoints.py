"""The clouds' metadata and host-agent endpoints are never reached from a job's URI unless the
operator names them in `preprocess.allow_networks`.

Azure's WireServer, 168.63.129.16, is public address space: the special-purpose table let the
fetcher connect to it, and from inside an Azure VM it answers with the VM's configuration (and
on some hosts certificates). The others sit inside blocks that `allow_private_networks` or a wide
`allow_networks` entry opens for media servers on the local network. The fetcher's real address
check runs here on IP-literal URIs; the connection it would open is recorded, never made.
"""

from __future__ import annotations

from ipaddress import ip_network

import pytest
from mmworker_preprocess import fetch
from mmworker_preprocess.errors import FetchFailed, ForbiddenUri
from mmworker_preprocess.fetch import check_allowed, fetch_bytes
from mmworker_preprocess.params import FetchPolicy
from mmworker_schemas.job import MediaRef

ENDPOINTS = [
    "168.63.129.16",  # Azure WireServer
    "169.254.169.254",  # AWS, Azure, GCP, Oracle, ... metadata
    "169.254.170.2",  # AWS ECS task credentials
    "169.254.170.23",  # AWS EKS Pod Identity
    "169.254.0.23",  # Tencent Cloud
    "100.100.100.200",  # Alibaba Cloud
    "192.0.0.192",  # Oracle Cloud (older)
    "fd00:ec2::254",  # AWS over IPv6
    "fd00:ec2::23",  # AWS EKS Pod Identity over IPv6
    "fd20:ce::254",  # GCP over IPv6
]
#: The WireServer through the IPv6 forms that lead to it.
EMBEDDED = ["::ffff:168.63.129.16", "64:ff9b::a83f:8110", "2002:a83f:8110::1"]

#: Blocks an operator opens for media servers; none of them may open an endpoint inside.
WIDE = FetchPolicy(
    allow_private_networks=True,
    allow_networks=tuple(
        ip_network(c)
        for c in ("168.63.0.0/16", "169.254.0.0/16", "100.64.0.0/10", "192.0.0.0/24", "fd00::/8")
    ),
)


def _uri(address: str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}/metadata/instance?api-version=2021-02-01"


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Addresses the fetcher tried to open a connection to (refused at once, never reached)."""
    tried: list[str] = []

    def record(address: str) -> object:
        tried.append(address)
        raise ConnectionRefusedError(f"test: {address} not connected to")

    monkeypatch.setattr(fetch, "_open_socket", record)
    return tried


@pytest.mark.parametrize("policy", [FetchPolicy(), WIDE], ids=["default", "private-and-wide"])
@pytest.mark.parametrize("address", ENDPOINTS + EMBEDDED)
def test_a_cloud_endpoint_is_refused_before_any_connection(
    address: str, policy: FetchPolicy, connects: list[str]
) -> None:
    with pytest.raises(ForbiddenUri, match="cloud-metadata") as info:
        fetch_bytes(MediaRef(uri=_uri(address)), policy)
    assert not info.value.retryable
    assert "allow_networks" in info.value.message
    assert connects == []


def test_the_wide_policy_still_opens_its_media_servers(connects: list[str]) -> None:
    """Control: the wide policy does open ordinary addresses of those blocks (the fetch goes as
    far as the connection), so the refusals above are the endpoints', not the blocks'."""
    for address in ("168.63.1.1", "169.254.1.1", "100.100.100.201", "192.0.0.193", "fd00::1"):
        check_allowed(MediaRef(uri=_uri(address)), WIDE)
    with pytest.raises(FetchFailed, match="not connected to"):  # the socket's refusal
        fetch_bytes(MediaRef(uri=_uri("169.254.1.1")), WIDE, None)
    assert connects == ["169.254.1.1"]


@pytest.mark.parametrize("address", ENDPOINTS)
def test_an_allow_networks_entry_naming_the_endpoint_opens_it(address: str) -> None:
    prefix = 128 if ":" in address else 32
    policy = FetchPolicy(allow_networks=(ip_network(f"{address}/{prefix}"),))
    check_allowed(MediaRef(uri=_uri(address)), policy)


def test_deny_networks_still_wins_over_naming_the_endpoint() -> None:
    policy = FetchPolicy(
        allow_networks=(ip_network("168.63.129.16/32"),),
        deny_networks=(ip_network("168.63.0.0/16"),),
    )
    with pytest.raises(ForbiddenUri, match="deny_networks"):
        check_allowed(MediaRef(uri=_uri("168.63.129.16")), policy)
