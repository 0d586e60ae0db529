"""Publishing outcomes: a result or a dead letter is retried until the broker acknowledges it,
because an offset is committed only once its outcome is acknowledged (at-least-once).

`producer.send` blocks while metadata is missing or the buffer is full (`kafka.max_block_ms`):
it runs on threads of its own, one for each topic the worker writes (each takes one at most,
by a lock per topic) and one for the producer's other calls, so a topic that cannot be written
holds up no other.

Threads: `publish` and `call` run on the event loop; the producer's blocking calls run on the
publisher's threads."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kafka.errors import (
    ClusterAuthorizationFailedError,
    InvalidTopicError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
)

from mmworker.config import KafkaConfig
from mmworker.errors import PublishRefused, TopicRefused, UnknownReplyTopic
from mmworker.jobs import Outcome
from mmworker.kafka_io import TopicCheck, send, topic_exists

#: The worker's own name, whichever of its parts logs: operators filter its lines on it.
log = logging.getLogger("mmworker.worker")

T = TypeVar("T")

#: Refusals of one record (its size): the job is dead-lettered and the partition moves on.
RECORD_REFUSALS = (MessageSizeTooLargeError, RecordListTooLargeError)
#: Refusals of a whole topic: every record would fail the same way, so the worker stops. Any
#: other error, retriable or not (kafka-python marks some transient producer errors, such as an
#: idempotent producer's epoch bump, non-retriable), is retried with backoff.
TOPIC_REFUSALS = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError, InvalidTopicError)


class Publisher:
    def __init__(
        self, cfg: KafkaConfig, producer: Any, reply_topics: TopicCheck | None = None
    ) -> None:
        """`reply_topics`: how to find out whether a job's reply topic exists (default: ask
        the broker, remembering the answer)."""
        self._cfg = cfg
        self.producer = producer
        written = {cfg.output_topic, cfg.dead_letter_topic, *cfg.reply_topics}
        self._threads = ThreadPoolExecutor(len(written) + 1, thread_name_prefix="publish")
        self._sending: dict[str, asyncio.Lock] = {}
        self._reply_topics = reply_topics or TopicCheck(
            functools.partial(topic_exists, cfg, timeout_ms=cfg.max_block_ms)
        )

    async def publish(self, outcome: Outcome) -> None:
        """Retry until the broker acknowledges: an unacknowledged output must never be committed.

        Raises `PublishRefused` for a record refused for its size, `UnknownReplyTopic` for a
        job's reply topic the broker does not have (asked before the first send, and again when
        a send could not get the topic's metadata), `TopicRefused` for a topic that refuses
        everything; see RECORD_REFUSALS and TOPIC_REFUSALS.
        """
        value = outcome.record.model_dump_json().encode()
        k = self._cfg
        reply = outcome.topic not in (k.output_topic, k.dead_letter_topic)
        lock = self._sending.setdefault(outcome.topic, asyncio.Lock())
        delay = 0.2
        while True:
            if reply and not await self._reply_topics.exists(outcome.topic):
                raise UnknownReplyTopic(
                    "the topic does not exist on the broker (kafka.reply_topics allows it: "
                    "create it, then replay the job)"
                )
            try:
                await send(self.producer, outcome.topic, outcome.key, value, outcome.kind,
                           self._threads, lock)  # fmt: skip
                return
            except RECORD_REFUSALS as exc:
                raise PublishRefused(f"{type(exc).__name__}: {exc}") from exc
            except TOPIC_REFUSALS as exc:
                raise TopicRefused(f"{outcome.topic}: {type(exc).__name__}: {exc}") from exc
            except KafkaError as exc:
                if isinstance(exc, KafkaTimeoutError):  # no metadata: deleted since it was found?
                    self._reply_topics.forget(outcome.topic)
                log.warning(
                    "publish to %s failed (%s); retrying in %.1fs", outcome.topic, exc, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Another blocking call that writes through the producer (the suspects topic, flush,
        close), on the publisher's threads: never on the event loop, nor on the Kafka thread
        that polls."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, lambda: fn(*args))

    def shutdown(self) -> None:
        """The threads go once their calls end; a send still blocked does not hold the exit."""
        self._threads.shutdown(wait=False)
