"""A small Python client for services that post jobs and read their answers.

The wire contract (topics, keys, JSON shapes) is the worker's, so a producer written against raw
kafka-python re-implements it and drifts. `Client` is what `mmworker submit` and `mmworker tail`
use themselves:

    from mmworker.client import Client
    from mmworker.config import load_config
    from mmworker_schemas import Failure, Job, MediaRef

    with Client(load_config()) as client:
        job = Job(job_id="cat-1", media=[MediaRef(uri="https://example.com/cat.jpg")])
        client.post(job).result(timeout=30)          # an Ack once the broker has the job
        for answer in client.results({"cat-1"}, timeout=120):
            print(answer.message if isinstance(answer, Failure) else answer.text)

Reading survives a broker that goes away and comes back: the client checks the bootstrap
servers itself while nothing arrives (a TCP connect, and on a plaintext listener a Kafka
ApiVersions answer, since a stopped broker still accepts connections), says once that they are
lost and once that they are back (`on_event`, a log line by default), and goes on from where it
was. kafka-python, left alone,
logs every failed attempt (47 ERROR/WARNING lines in 30 s) and never says the broker is gone. A
topic found recreated on its return (a broker without persistent storage forgets its topics,
and whoever recreates them starts their offsets at 0 again) is read from its beginning, so
records written after the return are not skipped because an old offset was further on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import KafkaError
from mmworker_schemas import Failure, Job, Result
from pydantic import ValidationError

from mmworker.config import WorkerConfig
from mmworker.kafka_io import posting_producer

log = logging.getLogger(__name__)

#: How often the bootstrap servers are checked while no record arrives.
PROBE_INTERVAL_S = 2.0
#: How long one server may take to accept a TCP connection before it counts as gone.
PROBE_TIMEOUT_S = 1.0
#: How long a broker that accepts the connection may take to answer before it counts as hung.
ANSWER_TIMEOUT_S = 5.0
#: kafka-python waits up to 30 s between reconnection attempts by default; a broker that comes
#: back should be read again within seconds.
RECONNECT_BACKOFF_MAX_MS = 1000
_POLL_MS = 500


@dataclass(frozen=True, slots=True)
class Ack:
    """Where the broker stored a posted job."""

    job_id: str
    topic: str
    partition: int
    offset: int


def parse_answer(value: bytes | None) -> Result | Failure | None:
    """A record of the output or dead-letter topic as a `Result` or `Failure`; None for anything
    else (not JSON, another shape), which a reader skips."""
    if value is None:
        return None
    try:
        doc = json.loads(value)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    model: type[Result] | type[Failure] = Failure if "code" in doc else Result
    try:
        return model.model_validate(doc)
    except ValidationError:
        return None


def unreachable(
    servers: Iterable[str],
    timeout_s: float = PROBE_TIMEOUT_S,
    *,
    answer_timeout_s: float | None = None,
) -> str | None:
    """Why none of `servers` accepts a TCP connection, or None when one does. A broker process
    that is gone refuses at once; the check does not need kafka-python's view of the cluster.

    With `answer_timeout_s` (plaintext listeners only) the server must also answer a Kafka
    ApiVersions request within that time: a stopped or hung broker still accepts connections
    (the kernel completes them), but answers nothing."""
    problems: list[str] = []
    for server in servers:
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as s:
                if answer_timeout_s is None or _answers_api_versions(s, answer_timeout_s):
                    return None
                problems.append(f"{server}: no Kafka answer within {answer_timeout_s:g}s")
        except socket.gaierror:
            problems.append(f"{server}: no such host")
        except TimeoutError:
            problems.append(f"{server}: no answer within {timeout_s:g}s")
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            problems.append(f"{server}: {reason.lower()}")
    return "; ".join(problems) or "no bootstrap servers"


#: ApiVersions v0 (api key 18), correlation id 1, client id "mmworker-probe": the request every
#: Kafka client sends first, which any broker answers before authentication.
_PROBE_REQUEST = struct.pack(">hhih", 18, 0, 1, len(b"mmworker-probe")) + b"mmworker-probe"
_API_VERSIONS = struct.pack(">i", len(_PROBE_REQUEST)) + _PROBE_REQUEST


def _answers_api_versions(sock: socket.socket, timeout_s: float) -> bool:
    """True when the broker answers ApiVersions (its size and our correlation id) in time."""
    sock.settimeout(timeout_s)
    try:
        sock.sendall(_API_VERSIONS)
        head = b""
        while len(head) < 8:
            chunk = sock.recv(8 - len(head))
            if not chunk:
                return False
            head += chunk
    except OSError:  # TimeoutError included: no answer in time
        return False
    _size, correlation_id = struct.unpack(">ii", head)
    return bool(correlation_id == 1)


class Client:
    """Posts jobs to the worker's input topic and reads results and failures, with the worker's
    own connection settings (`cfg.kafka`: brokers, TLS, SASL, topic names)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        *,
        on_event: Callable[[str], None] | None = None,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.cfg = cfg
        self._on_event = on_event or log.warning
        self._probe_interval_s = probe_interval_s
        self._producer: KafkaProducer | None = None

    # -- posting ---------------------------------------------------------------------------

    def post(self, job: Job, topic: str | None = None) -> Future[Ack]:
        """Send `job` (keyed by its job_id, as the worker expects) to `topic` (default:
        kafka.input_topic). The future holds an `Ack` once the broker has it, or kafka-python's
        error; nothing is retried here beyond the producer's own retries."""
        target = topic or self.cfg.kafka.input_topic
        value = job.model_dump_json(exclude_defaults=True).encode()
        done: Future[Ack] = Future()
        sent = self.producer.send(target, key=job.job_id.encode(), value=value)
        sent.add_callback(
            lambda meta: done.set_result(Ack(job.job_id, meta.topic, meta.partition, meta.offset))
        )
        sent.add_errback(done.set_exception)
        return done

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every job posted so far is acknowledged or refused."""
        if self._producer is not None:
            self._producer.flush(timeout=timeout_s)

    @property
    def producer(self) -> KafkaProducer:
        if self._producer is None:
            self._producer = posting_producer(self.cfg.kafka)
        return self._producer

    # -- reading ---------------------------------------------------------------------------

    def results(
        self,
        job_ids: Iterable[str] | None = None,
        timeout: float | None = None,
        *,
        from_now: bool = False,
        topics: list[str] | None = None,
    ) -> Iterator[Result | Failure]:
        """Results and failures, from the output and dead-letter topics. With `job_ids`, only
        theirs, and it stops once each has an answer; it stops too after `timeout` seconds
        without a new record (None: never). A job answered twice (at-least-once) is yielded
        once. Records that are neither a Result nor a Failure are skipped."""
        wanted = set(job_ids) if job_ids is not None else None
        if wanted is not None and not wanted:
            return
        seen: set[str] = set()
        for record in self.records(topics, idle_timeout_s=timeout, from_now=from_now):
            answer = parse_answer(record.value)
            if answer is None:
                log.debug("skipped a record of %s that is not a Result or Failure", record.topic)
                continue
            job_id = answer.job_id
            if wanted is not None and job_id not in wanted:
                continue
            if job_id is not None:
                if job_id in seen:
                    continue
                seen.add(job_id)
            yield answer
            if wanted is not None and wanted <= seen:
                return

    def records(
        self,
        topics: list[str] | None = None,
        *,
        idle_timeout_s: float | None = None,
        from_now: bool = False,
    ) -> Iterator[Any]:
        """Raw kafka-python records of `topics` (default: output and dead-letter), without a
        consumer group. Stops after `idle_timeout_s` without a record (None: never), whether
        or not the brokers are there."""
        kafka = self.cfg.kafka
        names = topics or [kafka.output_topic, kafka.dead_letter_topic]
        consumer = KafkaConsumer(
            *names,
            auto_offset_reset="latest" if from_now else "earliest",
            enable_auto_commit=False,
            group_id=None,
            fetch_max_bytes=kafka.fetch_max_bytes,
            max_partition_fetch_bytes=kafka.max_partition_fetch_bytes,
            reconnect_backoff_max_ms=RECONNECT_BACKOFF_MAX_MS,
            **kafka.client_kwargs(),
        )
        try:
            yield from _Reader(self, consumer, idle_timeout_s).records()
        finally:
            consumer.close()

    def missing_topics(self, topics: list[str]) -> list[str]:
        """Those of `topics` the brokers do not have (yet)."""
        consumer = KafkaConsumer(group_id=None, **self.cfg.kafka.client_kwargs())
        try:
            return sorted(set(topics) - set(consumer.topics()))
        finally:
            consumer.close()

    def event(self, message: str) -> None:
        self._on_event(message)

    # -- lifetime --------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close(timeout=timeout_s)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Reader:
    """One consumer's read loop: records as they come, the brokers watched while none do."""

    def __init__(self, client: Client, consumer: KafkaConsumer, idle_timeout_s: float | None):
        self.client = client
        self.consumer = consumer
        self.idle_timeout_s = idle_timeout_s
        self.servers = client.cfg.kafka.bootstrap_servers.split(",")
        # A TLS listener needs a handshake first: there, being reachable is accepting TCP.
        plaintext = client.cfg.kafka.security_protocol == "PLAINTEXT"
        self.answer_timeout_s = ANSWER_TIMEOUT_S if plaintext else None
        self.topic_ids: dict[str, object] = {}
        self.lost_since: float | None = None

    def records(self) -> Iterator[Any]:
        last_record = next_probe = time.monotonic()
        while True:
            batch = self.consumer.poll(timeout_ms=_POLL_MS)
            now = time.monotonic()
            records = [r for tp in sorted(batch) for r in batch[tp]]
            if records and self.lost_since is not None:
                self._back(now)
            if records and self._recreated({r.topic for r in records}):
                continue  # read again from the beginning of the new topic
            if records:
                last_record = next_probe = now
                yield from records
                continue
            if now >= next_probe:
                next_probe = now + self.client._probe_interval_s
                self._probe(now)
            if self.idle_timeout_s is not None and now - last_record >= self.idle_timeout_s:
                return

    def _probe(self, now: float) -> None:
        why = unreachable(self.servers, answer_timeout_s=self.answer_timeout_s)
        if why is not None:
            if self.lost_since is None:
                self.lost_since = now
                self.client.event(
                    f"lost the Kafka brokers ({why}); waiting for them to come back (Ctrl-C stops)"
                )
            return
        if self.lost_since is not None:
            self._back(now)
        topics = set(self.consumer.subscription() or ())
        with contextlib.suppress(KafkaError):
            for topic in sorted(topics):
                # Fresh metadata where a topic is unknown: kafka-python drops a topic that was
                # gone at a refresh and looks again only after metadata_max_age_ms (5 min).
                self.consumer.partitions_for_topic(topic)
        self._recreated(topics)

    def _back(self, now: float) -> None:
        """Say so, and fetch the topics' metadata before a record of the brokers' new life is
        passed on: kafka-python fetches by topic name, so records of a topic created again
        arrive before its cached id changes, at positions of the old topic."""
        assert self.lost_since is not None
        away = now - self.lost_since
        self.lost_since = None
        self.client.event(f"the Kafka brokers are back after {away:.1f}s; reading on")
        with contextlib.suppress(KafkaError):
            self.consumer.topics()

    def _cluster(self) -> Any:
        return getattr(getattr(self.consumer, "_client", None), "cluster", None)

    def _recreated(self, topics: set[str]) -> bool:
        """True when one of `topics` has another id than when it was first seen: deleted
        and created again (a broker restarted without persistent storage), so the positions
        held are of the old topic and the new one is read from its beginning."""
        cluster = self._cluster()
        if cluster is None or not hasattr(cluster, "topic_id"):
            return False
        assigned = self.consumer.assignment()
        renewed: list[str] = []
        for topic in sorted(topics):
            now_id = cluster.topic_id(topic)
            before = self.topic_ids.get(topic)
            if now_id is not None and before is None:
                self.topic_ids[topic] = now_id
            elif now_id is not None and now_id != before:
                if not any(tp.topic == topic for tp in assigned):
                    continue  # not assigned again yet: the next check seeks it
                self.topic_ids[topic] = now_id
                renewed.append(topic)
        if not renewed:
            return False
        self.consumer.seek_to_beginning(*(tp for tp in assigned if tp.topic in renewed))
        self.client.event(
            f"topic {', '.join(renewed)} was created again while the brokers were away: "
            "reading it from its beginning"
        )
        return True
