"""Which IP addresses a job's URI may make the worker connect to.

The special-purpose ranges are an explicit table taken from the IANA IPv4 and IPv6
Special-Purpose Address Registries (and the IPv6 address-space registry for blocks never
allocated), not `ipaddress`'s `is_private`/`is_global` flags: those flags changed between Python
patch releases (192.0.0.0/24 was global on some, fec0::/10 site-local is private on none), and a
security boundary must not move when the interpreter is upgraded.

Addresses that carry an IPv4 address inside an IPv6 one (IPv4-mapped, NAT64, 6to4) are judged by
the IPv4 address they lead to, since that is where the packets end up.

Order of the rules, strongest first: `deny_networks` (operator), then the table, which
`allow_private_networks` opens for loopback/private/link-local blocks only and `allow_networks`
opens block by block.

The clouds' metadata and host-agent endpoints (`CLOUD_ENDPOINTS`) hand out instance credentials
or configuration to whatever on the VM asks, so a job's URI must never reach them: they are
refused even where they sit in public space (Azure's 168.63.129.16), `allow_private_networks`
does not open them, and `allow_networks` opens one only with an entry inside it (naming the
endpoint itself: a media server's 169.254.0.0/16 does not open 169.254.169.254).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

from mmworker_preprocess.params import FetchPolicy

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network


@dataclass(frozen=True, slots=True)
class SpecialRange:
    network: IPNetwork
    label: str
    #: The operator's `allow_private_networks` switch opens it (loopback, private, link-local):
    #: the networks a self-hosted media server plausibly lives on. Documentation, multicast,
    #: broadcast, benchmarking and protocol ranges never hold one and stay closed.
    internal: bool = False
    #: A cloud's metadata or host-agent endpoint: opened only by an `allow_networks` entry
    #: inside it (see the module's docstring).
    cloud_endpoint: bool = False


def _v4(cidr: str, label: str, internal: bool = False) -> SpecialRange:
    return SpecialRange(IPv4Network(cidr), label, internal)


def _v6(cidr: str, label: str, internal: bool = False) -> SpecialRange:
    return SpecialRange(IPv6Network(cidr), label, internal)


def _cloud(cidr: str) -> SpecialRange:
    network = IPv4Network(cidr) if ":" not in cidr else IPv6Network(cidr)
    return SpecialRange(network, "cloud-metadata", cloud_endpoint=True)


#: Metadata and host-agent endpoints of the clouds, each one address. Most sit inside a block of
#: the tables below, which they come before (the first matching row names an address).
CLOUD_ENDPOINTS: tuple[SpecialRange, ...] = (
    _cloud("168.63.129.16/32"),  # Azure WireServer (host agent: VM configuration, certificates)
    _cloud("169.254.169.254/32"),  # AWS, Azure, GCP, Oracle, DigitalOcean, OpenStack metadata
    _cloud("169.254.170.2/32"),  # AWS ECS task metadata and credentials
    _cloud("169.254.170.23/32"),  # AWS EKS Pod Identity agent (credentials)
    _cloud("169.254.0.23/32"),  # Tencent Cloud metadata
    _cloud("100.100.100.200/32"),  # Alibaba Cloud metadata
    _cloud("192.0.0.192/32"),  # Oracle Cloud metadata (older instances)
    _cloud("fd00:ec2::254/128"),  # AWS metadata over IPv6
    _cloud("fd00:ec2::23/128"),  # AWS EKS Pod Identity agent over IPv6
    _cloud("fd20:ce::254/128"),  # GCP metadata over IPv6
)


#: The IPv4 cloud endpoints, then the IANA IPv4 Special-Purpose Address Registry, every entry,
#: plus 224/4 and 240/4. The first matching row names the address, so nested rows
#: (255.255.255.255 in 240/4) come first.
SPECIAL_IPV4: tuple[SpecialRange, ...] = (
    *(row for row in CLOUD_ENDPOINTS if row.network.version == 4),
    _v4("0.0.0.0/8", "unspecified"),  # "this network"; connecting to 0.0.0.0 reaches the host
    _v4("10.0.0.0/8", "private", internal=True),
    _v4("100.64.0.0/10", "non-global", internal=True),  # shared/carrier NAT
    _v4("127.0.0.0/8", "loopback", internal=True),
    _v4("169.254.0.0/16", "link-local", internal=True),
    _v4("172.16.0.0/12", "private", internal=True),
    _v4("192.0.0.0/24", "protocol-assignment"),  # DS-Lite, PCP/TURN anycast, NAT64 discovery
    _v4("192.0.2.0/24", "documentation"),
    _v4("192.31.196.0/24", "as112"),
    _v4("192.52.193.0/24", "amt"),
    _v4("192.88.99.0/24", "6to4-relay"),
    _v4("192.168.0.0/16", "private", internal=True),
    _v4("192.175.48.0/24", "as112"),
    _v4("198.18.0.0/15", "benchmarking"),
    _v4("198.51.100.0/24", "documentation"),
    _v4("203.0.113.0/24", "documentation"),
    _v4("224.0.0.0/4", "multicast"),
    _v4("255.255.255.255/32", "broadcast"),
    _v4("240.0.0.0/4", "reserved"),
)

#: Every block of the IPv6 address space that IANA has not allocated (2000::/3 is global unicast;
#: fc00::/7, fe80::/10, fec0::/10 and ff00::/8 have rows of their own).
_UNALLOCATED_IPV6 = (
    "::/8", "100::/8", "200::/7", "400::/6", "800::/5", "1000::/4", "4000::/3", "6000::/3",
    "8000::/3", "a000::/3", "c000::/3", "e000::/4", "f000::/5", "f800::/6", "fe00::/9",
)  # fmt: skip

#: The IPv6 cloud endpoints, then the IANA IPv6 Special-Purpose Address Registry (2001::/23 as
#: one block: Teredo, ORCHID, AMT, benchmarking, AS112 and the rest of the IETF protocol
#: assignments), then every block of the IPv6 address space outside 2000::/3 that IANA has not
#: allocated for unicast. The embedding prefixes (::ffff:0:0/96, 64:ff9b::/96, 64:ff9b:1::/48,
#: 2002::/16) are not here: see `embedded_ipv4`.
SPECIAL_IPV6: tuple[SpecialRange, ...] = (
    *(row for row in CLOUD_ENDPOINTS if row.network.version == 6),
    _v6("::/128", "unspecified"),
    _v6("::1/128", "loopback", internal=True),
    _v6("100::/64", "discard-only"),
    _v6("2001::/23", "protocol-assignment"),
    _v6("2001:db8::/32", "documentation"),
    _v6("2620:4f:8000::/48", "as112"),
    _v6("3fff::/20", "documentation"),
    _v6("5f00::/16", "srv6-sid"),
    _v6("fc00::/7", "private", internal=True),  # unique local
    _v6("fe80::/10", "link-local", internal=True),
    _v6("fec0::/10", "site-local", internal=True),  # deprecated, still routed in old networks
    _v6("ff00::/8", "multicast"),
    # Not allocated for global unicast (IANA IPv6 Address Space): never a media server.
    *(_v6(cidr, "reserved") for cidr in _UNALLOCATED_IPV6),
)

_MAPPED = IPv6Network("::ffff:0:0/96")
_NAT64 = IPv6Network("64:ff9b::/96")
_NAT64_LOCAL = IPv6Network("64:ff9b:1::/48")
_SIX_TO_FOUR = IPv6Network("2002::/16")


def parse_address(address: str) -> IPAddress:
    """The address without an IPv6 zone ("fe80::1%eth0"); ValueError when it is not one."""
    return ip_address(address.split("%", 1)[0])


def special_purpose(ip: IPAddress) -> SpecialRange | None:
    """The table row holding `ip`, with no look inside embedding prefixes."""
    table = SPECIAL_IPV4 if isinstance(ip, IPv4Address) else SPECIAL_IPV6
    return next((row for row in table if ip in row.network), None)


def embedded_ipv4(ip: IPAddress) -> tuple[IPv4Address, ...] | None:
    """The IPv4 addresses an IPv6 address leads to, or None when it embeds none.

    The local-use NAT64 prefix (RFC 8215) may be cut at /48, /56, /64 or /96, and each cut puts
    the IPv4 address in other bits (RFC 6052 §2.2); the operator's choice is unknowable here, so
    every reading is returned and each must pass. Readings in 0.0.0.0/8 are left out: no
    translator forwards to "this network", and every address of the common /96 layout reads as
    one under the shorter cuts, which would otherwise refuse all of them.
    """
    if isinstance(ip, IPv4Address):
        return None
    if ip in _MAPPED:
        return (IPv4Address(int(ip) & 0xFFFFFFFF),)
    if ip in _NAT64:
        return (IPv4Address(int(ip) & 0xFFFFFFFF),)
    if ip in _SIX_TO_FOUR:
        return (IPv4Address((int(ip) >> 80) & 0xFFFFFFFF),)
    if ip in _NAT64_LOCAL:
        n = int(ip)

        def bits(start: int, count: int) -> int:
            return (n >> (128 - start - count)) & ((1 << count) - 1)

        readings = (
            bits(48, 16) << 16 | bits(72, 16),  # /48: octet 8 (bits 64-71) is the zero "u" octet
            bits(56, 8) << 24 | bits(72, 24),  # /56
            bits(72, 32),  # /64
            bits(96, 32),  # /96
        )
        routable = [IPv4Address(v) for v in readings if v >> 24 != 0]
        return tuple(dict.fromkeys(routable)) or (IPv4Address(readings[-1]),)
    return None


def blockers(ip: IPAddress) -> list[tuple[IPAddress, SpecialRange]]:
    """Each special-purpose address behind `ip` with its row: `ip` itself, or for an embedding
    address the embedded IPv4 addresses that are special (the prefix itself is only a carrier)."""
    embedded = embedded_ipv4(ip)
    candidates: tuple[IPAddress, ...] = (ip,) if embedded is None else embedded
    found: list[tuple[IPAddress, SpecialRange]] = []
    for candidate in candidates:
        row = special_purpose(candidate)
        if row is not None:
            found.append((candidate, row))
    return found


def forbidden_reason(address: str) -> str | None:
    """Why `address` is special-purpose ("loopback", "private", ...), or None when it is public."""
    found = blockers(parse_address(address))
    return found[0][1].label if found else None


def refusal(
    address: str,
    policy: FetchPolicy,
    reason_of: Callable[[str], str | None] = forbidden_reason,
) -> str | None:
    """Why `policy` refuses a connection to `address` (a phrase for an error message), or None.

    `reason_of` is the table lookup; fetch passes its module attribute so that tests can declare
    a local test server public and still see what the policy does with a redirect's target.
    Raises ValueError when `address` is not an IP address.
    """
    ip = parse_address(address)
    embedded = embedded_ipv4(ip) or ()
    for form in (ip, *embedded):
        for net in policy.deny_networks:
            if form.version == net.version and form in net:
                return f"in {net}, which preprocess.deny_networks refuses"
    if reason_of(address) is None:
        return None
    for culprit, row in blockers(ip):
        if row.cloud_endpoint:
            if _named(culprit, row.network, policy.allow_networks):
                continue
            return (
                f"a {row.label} address (the cloud host's metadata or agent endpoint); only a "
                "preprocess.allow_networks entry naming it opens it"
            )
        if policy.allow_private_networks and row.internal:
            continue
        if _within(culprit, policy.allow_networks) or _within(ip, policy.allow_networks):
            continue
        return f"a {row.label} address; internal networks are not reachable from jobs"
    return None


def _named(ip: IPAddress, endpoint: IPNetwork, networks: tuple[IPNetwork, ...]) -> bool:
    """An allowed block holds `ip` and lies inside `endpoint` (not a wider block around it)."""
    inside = [net for net in networks if net.version == endpoint.version == ip.version]
    return any(ip in net and net.subnet_of(endpoint) for net in inside)  # type: ignore[arg-type]


def _within(ip: IPAddress, networks: tuple[IPNetwork, ...]) -> bool:
    return any(ip.version == net.version and ip in net for net in networks)
