"""Jobs that were inside the engine when it died, kept in Kafka so every worker of the group sees
them ("query of death" protection).

Why Kafka and not a local file: after an engine death the worker exits, and the partition may be
handed to a worker on another host before this one is back. The record must reach whoever owns
the partition next, and survive a SIGKILL of the worker that wrote it.

Layout: one compacted topic (`kafka.suspects_topic`), keyed by the input record's
``topic/partition/offset`` (unique, unlike job ids, and known even for unparseable payloads);
the value is JSON ``{"deaths": n, ...}``; a tombstone (null value) clears a job that later
finished. A worker reads the whole topic before consuming and again, up to its end, whenever it
is assigned partitions, i.e. before it starts any record of a partition a dead worker gave up.
It is written only by the partition's owner, so counts never race.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Protocol

from kafka import KafkaConsumer
from kafka.structs import TopicPartition as KafkaTP
from mmworker_schemas import SourceCoords

from mmworker.config import KafkaConfig

log = logging.getLogger(__name__)

REFRESH_TIMEOUT_S = 10.0
RECORD_TIMEOUT_S = 10.0


def suspect_key(source: SourceCoords) -> str:
    return f"{source.topic}/{source.partition}/{source.offset}"


class Suspects(Protocol):
    """What the worker needs (the unit tests' fake implements it in memory)."""

    def refresh(self) -> None: ...
    def deaths(self, source: SourceCoords) -> int: ...
    def record_deaths(self, sources: list[SourceCoords], worker_id: str) -> None: ...
    def clear(self, source: SourceCoords) -> None: ...
    def close(self) -> None: ...


class KafkaSuspects:
    """`refresh` runs on the worker's Kafka thread (it blocks); the rest is thread-safe."""

    def __init__(self, cfg: KafkaConfig, producer: Any) -> None:
        self._topic = cfg.suspects_topic
        self._producer = producer
        self._consumer = KafkaConsumer(
            group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
            **cfg.client_kwargs(),
        )  # fmt: skip
        self._deaths: dict[str, int] = {}
        self._lock = threading.Lock()
        self._assigned = False

    def refresh(self) -> None:
        """Read the topic up to its current end (bounded: a stale view only costs isolation)."""
        if not self._assigned:
            parts = self._consumer.partitions_for_topic(self._topic) or {0}
            tps = [KafkaTP(self._topic, p) for p in sorted(parts)]
            self._consumer.assign(tps)
            self._consumer.seek_to_beginning(*tps)
            self._assigned = True
        tps = list(self._consumer.assignment())
        deadline = time.monotonic() + REFRESH_TIMEOUT_S
        while time.monotonic() < deadline:
            batches = self._consumer.poll(timeout_ms=200)
            for records in batches.values():
                for r in records:
                    self._apply(r.key, r.value)
            if not batches and self._caught_up(tps):
                return
        log.warning("suspects: %s not read to its end within %.0fs", self._topic, REFRESH_TIMEOUT_S)

    def _caught_up(self, tps: list[KafkaTP]) -> bool:
        # highwater() is known once a fetch answered (also for an empty partition); end_offsets
        # is avoided: some Kafka-protocol brokers report it wrongly.
        for tp in tps:
            high = self._consumer.highwater(tp)
            if high is None or self._consumer.position(tp) < high:
                return False
        return True

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        if key is None:
            return
        name = key.decode(errors="replace")
        with self._lock:
            if value is None:
                self._deaths.pop(name, None)
                return
            try:
                deaths = int(json.loads(value)["deaths"])
            except (ValueError, KeyError, TypeError):
                log.warning("suspects: ignoring malformed record %r", name)
                return
            self._deaths[name] = deaths

    def deaths(self, source: SourceCoords) -> int:
        with self._lock:
            return self._deaths.get(suspect_key(source), 0)

    def record_deaths(self, sources: list[SourceCoords], worker_id: str) -> None:
        """One more death for each; blocks until the broker has them (the worker exits next)."""
        futures = []
        for source in sources:
            key = suspect_key(source)
            with self._lock:
                deaths = self._deaths.get(key, 0) + 1
                self._deaths[key] = deaths
            value = {"deaths": deaths, "worker_id": worker_id, "at": time.time()}
            futures.append(
                self._producer.send(self._topic, key=key.encode(), value=json.dumps(value).encode())
            )
        for future in futures:
            future.get(timeout=RECORD_TIMEOUT_S)

    def clear(self, source: SourceCoords) -> None:
        """The suspect finished: forget it (fire and forget; a lost tombstone only means it is
        isolated once more if redelivered)."""
        key = suspect_key(source)
        with self._lock:
            if self._deaths.pop(key, None) is None:
                return
        self._producer.send(self._topic, key=key.encode(), value=None)

    def close(self) -> None:
        self._consumer.close()
