"""Who is in the workers' consumer group, asked of the group's coordinator.

Why not the clients' own calls: kafka-python's `describe_groups` always asks for the group's
authorized operations and then fails on the embedded Tansu broker's answer to that (every bit set,
"15 is not a valid ACLOperation"), and librdkafka's `describe_consumer_groups` misreads Tansu's
answer (no members, a member id where the assignor goes). The DescribeGroups request itself is
fine on both: it is sent here without asking for authorized operations (versions 0-5, whichever
the broker supports highest) and its members are read directly. Apache Kafka answers with each
member's client id, host and assignment; Tansu 0.6 only with member ids (client id and a UUID),
so there the assignment is "not reported" (None), never guessed.

The request goes through kafka-python's connection manager and coordinator lookup (private API
of the pinned 3.0.12 release), hence all of it here, in one place.
"""

from __future__ import annotations

import logging
import re
import struct
import threading
from dataclasses import dataclass

from kafka import KafkaAdminClient
from kafka.errors import GroupIdNotFoundError, KafkaError
from kafka.errors import for_code as kafka_error
from kafka.protocol.admin import DescribeGroupsRequest
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment

from mmworker.config import KafkaConfig
from mmworker.errors import WorkerError

log = logging.getLogger(__name__)

#: Kafka member ids are the client id, a dash and a UUID (Apache Kafka and Tansu alike).
_MEMBER_UUID = re.compile(r"-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
#: The highest DescribeGroups version whose answer is read here (v6 adds only error messages).
_MAX_VERSION = 5


class GroupQueryError(WorkerError):
    """The brokers did not answer a question about the consumer group."""


@dataclass(frozen=True, slots=True)
class Member:
    member_id: str
    client_id: str
    #: Where the member connects from; None where the broker does not say (Tansu).
    host: str | None
    #: (topic, partition) pairs assigned to it; None where the broker does not say (Tansu).
    partitions: tuple[tuple[str, int], ...] | None


@dataclass(frozen=True, slots=True)
class GroupMembers:
    group: str
    #: The coordinator's word: Stable, PreparingRebalance, CompletingRebalance, Empty or Dead.
    state: str
    members: tuple[Member, ...]


def describe_members(admin: KafkaAdminClient, group: str) -> GroupMembers:
    """The group's state and live members; a group the coordinator does not know is "Dead" with
    none. Raises `GroupQueryError` when the brokers do not answer."""

    async def ask() -> object:
        coordinator = await admin._find_coordinator_id(group)
        request = DescribeGroupsRequest(
            groups=[group], include_authorized_operations=False, max_version=_MAX_VERSION
        )
        return await admin._manager.send(request, node_id=coordinator)

    try:
        response = admin._manager.run(ask)
    except KafkaError as exc:
        raise GroupQueryError(
            f"cannot describe consumer group {group!r} ({type(exc).__name__}: {exc})"
        ) from exc
    (described,) = response.groups
    error = kafka_error(described.error_code)
    if error is GroupIdNotFoundError:
        return GroupMembers(group, "Dead", ())
    if described.error_code:
        raise GroupQueryError(f"cannot describe consumer group {group!r} ({error.__name__})")
    members = tuple(
        Member(
            member_id=m.member_id,
            client_id=m.client_id or _MEMBER_UUID.sub("", m.member_id),
            host=(m.client_host or "").lstrip("/") or None,
            partitions=_assigned(m.member_assignment),
        )
        for m in described.members
    )
    return GroupMembers(group, described.group_state, members)


def _assigned(raw: bytes) -> tuple[tuple[str, int], ...] | None:
    if not raw:
        return None
    try:
        assignment = ConsumerProtocolAssignment.decode(raw)
    except (struct.error, ValueError):
        return None  # not the consumer protocol's encoding: nothing to show
    return tuple(sorted((tp.topic, tp.partition) for tp in assignment.partitions()))


def idle_group_warning(cfg: KafkaConfig, timeout_s: float = 3.0) -> str | None:
    """One line for `submit` and `backfill` when the worker group has no live member: their
    jobs would wait, unseen, until a worker runs (issue #35). None when members are there, and
    also when the brokers cannot say within `timeout_s`: this is advice, the command goes on.
    The question runs on a thread of its own, bounded: a client's bootstrap can outlast its own
    deadline (a TLS handshake with a plaintext listener never completes)."""
    found: list[GroupMembers] = []

    def ask() -> None:
        timeout_ms = int(timeout_s * 1000)
        try:
            admin = KafkaAdminClient(
                **cfg.client_kwargs(),
                bootstrap_timeout_ms=timeout_ms,
                request_timeout_ms=timeout_ms,
            )
        except (KafkaError, OSError, ValueError) as exc:
            log.debug("no group check: %r", exc)
            return
        try:
            found.append(describe_members(admin, cfg.group_id))
        except GroupQueryError as exc:
            log.debug("no group check: %s", exc)
        finally:
            admin.close()

    thread = threading.Thread(target=ask, name="group-check", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if not found or found[0].members:
        return None
    return (
        f"warning: no worker is consuming group {cfg.group_id!r} on {cfg.bootstrap_servers}: the "
        "jobs wait until one runs (`mmworker status` shows the group)"
    )
