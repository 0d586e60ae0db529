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
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

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
from mmworker.kafka_io import TopicCheck, record_headers, send, topic_exists

#: The worker's own name, whichever of its parts logs: operators filter its lines on it.
log = logging.getLogger("mmworker.worker")

T = TypeVar("T")

#: Refusals of one record (its size): the job is dead-lettered and the partition moves on.
RECORD_REFUSALS = (MessageSizeTooLargeError, RecordListTooLargeError)
#: Refusals of a whole topic: every record would fail the same way, so the worker stops. Any
#: other error, retriable or not (kafka-python marks some transient producer errors, such as an
#: idempotent producer's epoch bump, non-retriable), is retried with backoff.
TOPIC_REFUSALS = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError, InvalidTopicError)
#: Producers one record may put in their fatal state before it counts as refused for good.
RENEWALS_PER_RECORD = 2


class RenewableProducer:
    """The worker's producer, replaced when kafka-python has given it up.

    Why: kafka-python's idempotent producer (the default, `kafka.enable_idempotence`) puts
    itself in a fatal state for good when the broker refuses a record it cannot split or retry:
    one result over a topic's `max.message.bytes`, a timestamp out of range. From then on every
    send fails with that same error, so the dead letter for the refused result failed too and
    the worker stopped (exit 4), to be restarted into the same record: a crash loop on one job.
    Everything that writes (results, dead letters, the suspects topic, flush and close) goes
    through this object, so one replacement reaches them all.
    """

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self.current = make()

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self.current.send(*args, **kwargs)

    def flush(self, timeout: float | None = None) -> None:
        self.current.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        self.current.close(timeout)

    def refused_alone(self, topic: str, key: str, value: bytes, kind: str) -> BaseException | None:
        """Send one record on a producer of its own, with nothing else in flight: the error if
        that producer gives it up too (the broker refuses this very record), None once it is
        acknowledged. Why: a fatal state fails every record in flight with the same error, so
        a record that renewed producers twice may only have been in flight when others were
        refused; dead-lettering it on that count lost its result. Raises KafkaError for any
        other failure (retried). Blocking: on the publisher's threads."""
        probe = self._make()
        try:
            try:
                # No timeout of our own: the producer's delivery timeout ends the wait. Cut
                # short, the record was still in flight: close(0) then fails (the probe leaked
                # its thread and connections) and the copy could still land beside the resend.
                probe.send(topic, key=key.encode(), value=value, headers=record_headers(kind)).get()
            except KafkaError as exc:
                if given_up(probe) is None:
                    raise
                refused: BaseException = exc
                return refused
            return None
        finally:
            try:
                probe.close(0)
            except KafkaError as exc:  # still something in flight: it is dropped
                log.warning("the producer that sent a record alone did not close: %s", exc)

    def renew_if_given_up(self) -> bool:
        """A new producer if the current one is in its fatal state; True if it was replaced.
        Blocking (the new one bootstraps): on the publisher's threads."""
        with self._lock:
            failed = given_up(self.current)
            if failed is None:
                return False
            try:
                fresh = self._make()
            except KafkaError as exc:  # the brokers are gone meanwhile: asked again later
                log.warning(
                    "the producer stopped sending after the broker refused a record (%s), and "
                    "a new one could not reach the brokers (%s)", failed, exc,
                )  # fmt: skip
                return False
            old, self.current = self.current, fresh
        log.warning(
            "the producer stopped sending after the broker refused a record (%s): replaced by a "
            "new one", failed,
        )  # fmt: skip
        old.close(0)
        return True


def given_up(producer: Any) -> BaseException | None:
    """The error that put kafka-python's idempotent producer in its fatal state, or None. It
    has no public way to ask: this reads its transaction manager (kafka-python 3.0)."""
    manager = getattr(producer, "_transaction_manager", None)
    if manager is None or not manager.has_fatal_error():
        return None
    return cast(BaseException | None, manager.last_error) or RuntimeError("fatal state")


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
        renewed = 0
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
                await self.renew_if_given_up()  # the dead letter for it must still go out
                raise PublishRefused(f"{type(exc).__name__}: {exc}") from exc
            except TOPIC_REFUSALS as exc:
                raise TopicRefused(f"{outcome.topic}: {type(exc).__name__}: {exc}") from exc
            except KafkaError as exc:
                error = exc  # or, after a probe, the probe's own failure
                if await self.renew_if_given_up():
                    renewed += 1
                    if renewed < RENEWALS_PER_RECORD:
                        continue  # refused by a producer that refused everything: try a new one
                    # Again: this record (InvalidTimestampError, an unknown server error), or
                    # another one in flight beside it each time? Sent alone, it tells. Sent
                    # again and again, it renewed producers without end and was never
                    # dead-lettered.
                    try:
                        refused = await self.call(
                            self.producer.refused_alone, outcome.topic, outcome.key, value,
                            outcome.kind,
                        )  # fmt: skip
                    except KafkaError as failed:  # not an answer about the record: again
                        error = failed
                    else:
                        if refused is None:
                            return
                        raise PublishRefused(
                            f"{type(refused).__name__}: {refused} (refused again by a producer "
                            "that sent it alone)"
                        ) from exc
                if isinstance(error, KafkaTimeoutError):  # no metadata: deleted since it was found?
                    self._reply_topics.forget(outcome.topic)
                log.warning(
                    "publish to %s failed (%s); retrying in %.1fs", outcome.topic, error, delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def renew_if_given_up(self) -> bool:
        if not isinstance(self.producer, RenewableProducer):
            return False  # a test's stand-in
        return await self.call(self.producer.renew_if_given_up)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Another blocking call that writes through the producer (the suspects topic, flush,
        close), on the publisher's threads: never on the event loop, nor on the Kafka thread
        that polls."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, lambda: fn(*args))

    def shutdown(self) -> None:
        """The threads go once their calls end; a send still blocked does not hold the exit."""
        self._threads.shutdown(wait=False)
