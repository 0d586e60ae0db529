"""The worker says itself when it loses the Kafka brokers and when they are back.

Why: kafka-python logs every failed attempt of every connection (a stopped broker gave dozens of
ERROR lines a second: socket disconnected, ECONNREFUSED, metadata refresh failed), which buries
the one fact an operator needs, and says nothing when the brokers return. The worker keeps going
meanwhile (jobs in flight finish, their results wait to be published, nothing is committed), so
the fact is "lost since T, back after N s". A TCP connect to the bootstrap servers every few
seconds tells it without kafka-python's internals; the per-attempt lines are dropped unless
log_level is DEBUG.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence

from mmworker.client import unreachable
from mmworker.config import KafkaConfig

log = logging.getLogger(__name__)

#: Seconds between two checks of the bootstrap servers.
CHECK_EVERY_S = 2.0
#: ... while they are lost: kafka-python reconnects within a second or so of their return, and the
#: "back" line should not trail the first results published by seconds.
CHECK_LOST_EVERY_S = 0.5
#: Most seconds a broker may take to answer ApiVersions before it counts as lost.
ANSWER_TIMEOUT_S = 5.0

#: kafka-python's words for one failed attempt on a lost connection (its loggers `kafka.*`).
CONNECTION_NOISE: tuple[str, ...] = (
    "socket disconnected",
    "ECONNREFUSED",
    "Connection lost",
    "Connection failed",
    "Metadata refresh: failed",
    "No node available for metadata refresh",
    "Error sending OffsetCommitRequest",
    "Unable to connect",
    "Node %s connection failed",
    "Closing connection",
    "Coordinator unknown",
    "Marking the coordinator dead",
)


class ConnectionNoise(logging.Filter):
    """Drops kafka-python's per-attempt connection lines; `watch_brokers` speaks for them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("kafka"):
            return True
        message = record.getMessage()
        return not any(part in message for part in CONNECTION_NOISE)


def quiet_connection_noise() -> None:
    """On this process's root handlers (a logger's own filter would not see `kafka.net.*`)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ConnectionNoise) for f in handler.filters):
            handler.addFilter(ConnectionNoise())


def probe_for(cfg: KafkaConfig) -> Callable[[Sequence[str]], str | None]:
    """A broker frozen or hung still accepts connections (the kernel completes them), so on
    listeners that speak Kafka before any handshake the check also waits for an answer to
    ApiVersions; on TLS ones a connect is all it asks."""
    if cfg.security_protocol in ("PLAINTEXT", "SASL_PLAINTEXT"):
        return functools.partial(unreachable, answer_timeout_s=ANSWER_TIMEOUT_S)
    return unreachable


async def watch_brokers(
    cfg: KafkaConfig,
    on_change: Callable[[bool], None] = lambda _up: None,
    every_s: float = CHECK_EVERY_S,
    probe: Callable[[Sequence[str]], str | None] | None = None,
    lost_every_s: float = CHECK_LOST_EVERY_S,
) -> None:
    """Log one line when none of the bootstrap servers answers and one when one does again."""
    servers = cfg.bootstrap_servers.split(",")
    probe = probe or probe_for(cfg)
    lost_at: float | None = None
    while True:
        reason = await asyncio.to_thread(probe, servers)
        now = time.monotonic()
        if reason is not None and lost_at is None:
            lost_at = now
            on_change(False)
            log.warning(
                "lost the Kafka brokers (%s): jobs in flight go on, their results wait to be "
                "published and nothing is committed until they are back",
                reason,
            )
        elif reason is None and lost_at is not None:
            log.info("Kafka brokers back after %.0fs", now - lost_at)
            lost_at = None
            on_change(True)
        await asyncio.sleep(every_s if lost_at is None else lost_every_s)
