"""In-memory stand-ins for the clients behind `mmworker.worker.Clients`, and a scripted runner.

They keep the contracts the loop relies on from kafka-python: `poll` returns at most
`max_records` from unpaused assigned partitions and runs rebalance callbacks inside itself;
`commit` takes {TopicPartition: OffsetAndMetadata}; `send` returns a future settled by callbacks.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from mmworker_schemas import Failure, Result, SourceCoords
from mmworker_schemas.codes import ErrorCode

from mmworker.config import WorkerConfig, load_config
from mmworker.errors import EngineFatal
from mmworker.jobs import JobRunner, Outcome
from mmworker.metrics import Metrics
from mmworker.offsets import TopicPartition
from mmworker.records import Context
from mmworker.suspects import suspect_key
from mmworker.worker import Worker

INPUT, OUTPUT, DLQ = "jobs", "out", "dlq"


def record(partition: int, offset: int, job_id: str | None = None) -> Any:
    job_id = job_id or f"p{partition}-o{offset}"
    value = json.dumps({"job_id": job_id, "media": [{"uri": "https://example.test/a.jpg"}]})
    return SimpleNamespace(topic=INPUT, partition=partition, offset=offset, key=None,
                           value=value.encode(), timestamp=0)  # fmt: skip


class Future:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def add_callback(self, fn: Any) -> None:
        if self.error is None:
            fn("metadata")

    def add_errback(self, fn: Any) -> None:
        if self.error is not None:
            fn(self.error)

    def get(self, timeout: float | None = None) -> str:
        if self.error is not None:
            raise self.error
        return "metadata"


class Producer:
    """Fails `refuse[topic]`'s errors in turn, then accepts. kafka-python raises some from
    send() (the producer's own size check) and reports others through the future (the broker's
    answer); `broker_side` picks the latter."""

    def __init__(
        self, refuse: dict[str, list[Exception]] | None = None, broker_side: bool = False
    ) -> None:
        self.refuse = refuse or {}
        self.broker_side = broker_side
        self.sent: list[tuple[str, str, dict[str, Any]]] = []
        self.flushed = self.closed = False

    def send(self, topic: str, *, key: bytes, value: bytes, headers: Any = None) -> Future:
        errors = self.refuse.get(topic)
        if errors:
            error = errors.pop(0)
            if self.broker_side:
                return Future(error)
            raise error
        self.sent.append((topic, key.decode(), json.loads(value)))
        return Future()

    def flush(self, timeout: float | None = None) -> None:
        self.flushed = True

    def close(self, timeout: float | None = None) -> None:
        self.closed = True

    def on(self, topic: str) -> list[dict[str, Any]]:
        return [doc for t, _, doc in self.sent if t == topic]


class Consumer:
    """Partitions of INPUT holding records; `rebalance` schedules callbacks for the next poll."""

    def __init__(self, records: dict[int, int]) -> None:
        self.logs = {TopicPartition(INPUT, p): [record(p, o) for o in range(n)]
                     for p, n in records.items()}  # fmt: skip
        self.positions = dict.fromkeys(self.logs, 0)
        self.owned: set[TopicPartition] = set(self.logs)
        self._paused: set[TopicPartition] = set()
        self.commits: list[dict[TopicPartition, int]] = []
        self.listener: Any = None
        self.pending_rebalance: tuple[str, list[TopicPartition]] | None = None
        self.closed = False
        self.poll_error: BaseException | None = None
        self.max_records_seen: list[int] = []
        self.lock = threading.Lock()

    def subscribe(self, topics: list[str], listener: Any) -> None:
        self.listener = listener

    def poll(self, timeout_ms: int, max_records: int) -> dict[Any, list[Any]]:
        if self.poll_error is not None:
            raise self.poll_error
        if self.pending_rebalance is not None:
            kind, tps = self.pending_rebalance
            self.pending_rebalance = None
            # kafka-python awaits the listener's coroutines on its own network loop.
            if kind == "revoke":
                asyncio.run(self.listener.on_partitions_revoked(tps))
                self.owned -= set(tps)
            elif kind == "lose":
                asyncio.run(self.listener.on_partitions_lost(tps))
                self.owned -= set(tps)
            elif kind == "lose+assign":  # evicted and re-admitted within one poll
                asyncio.run(self.listener.on_partitions_lost(tps))
                for tp in tps:  # redelivered from the last commit
                    self.positions[tp] = self.committed().get(tp, 0)
                asyncio.run(self.listener.on_partitions_assigned(tps))
            else:
                self.owned |= set(tps)
                asyncio.run(self.listener.on_partitions_assigned(tps))
        self.max_records_seen.append(max_records)
        out: dict[Any, list[Any]] = {}
        budget = max_records
        for tp in sorted(self.owned):
            if tp in self._paused or budget <= 0:
                continue
            log = self.logs[tp]
            take = log[self.positions[tp] : self.positions[tp] + budget]
            if take:
                out[tp] = take
                self.positions[tp] += len(take)
                budget -= len(take)
        return out

    def assignment(self) -> set[TopicPartition]:
        return set(self.owned)

    def highwater(self, tp: Any) -> int:
        return len(self.logs[TopicPartition(tp.topic, tp.partition)])

    @property
    def _subscription(self) -> Any:
        """What `kafka_io.may_have_records` reads the fetch position from (kafka-python's
        SubscriptionState: `position(tp)` has the offset)."""
        consumer = self

        class Subscription:
            def position(self, tp: Any) -> Any:
                return SimpleNamespace(
                    offset=consumer.positions[TopicPartition(tp.topic, tp.partition)]
                )

        return Subscription()

    def pause(self, *tps: Any) -> None:
        self._paused |= {TopicPartition(tp.topic, tp.partition) for tp in tps}

    def resume(self, *tps: Any) -> None:
        self._paused -= {TopicPartition(tp.topic, tp.partition) for tp in tps}

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def commit(self, offsets: dict[Any, Any], timeout_ms: int | None = None) -> None:
        self.commits.append({TopicPartition(tp.topic, tp.partition): om.offset
                             for tp, om in offsets.items()})  # fmt: skip

    def close(self, autocommit: bool = False, timeout_ms: int | None = None) -> None:
        self.closed = True

    @property
    def _coordinator(self) -> Any:
        """What `kafka_io.commit_in_rebalance` awaits inside a rebalance callback."""
        consumer = self

        class Coordinator:
            rejoin_needed = False  # `kafka_io.close_consumer` reads it

            def coordinator_unknown(self) -> bool:  # no broker: `heartbeat_now` sends nothing
                return True

            async def _commit_offsets_sync_async(self, offsets: Any, timeout_ms: int) -> None:
                consumer.commit(offsets)

        return Coordinator()

    def committed(self) -> dict[TopicPartition, int]:
        out: dict[TopicPartition, int] = {}
        for c in self.commits:
            out.update(c)
        return out


class Suspects:
    def __init__(self, deaths: dict[str, int] | None = None) -> None:
        self.table = dict(deaths or {})
        self.recorded: list[list[SourceCoords]] = []
        self.cleared: list[str] = []
        self.refreshes = 0

    def refresh(self) -> None:
        self.refreshes += 1

    def deaths(self, source: SourceCoords) -> int:
        return self.table.get(suspect_key(source), 0)

    def record_deaths(self, sources: list[SourceCoords], worker_id: str) -> None:
        self.recorded.append(list(sources))
        for s in sources:
            self.table[suspect_key(s)] = self.table.get(suspect_key(s), 0) + 1

    def clear(self, source: SourceCoords) -> None:
        self.cleared.append(suspect_key(source))
        self.table.pop(suspect_key(source), None)

    def close(self) -> None:
        pass


class Clients:
    def __init__(self, consumer: Consumer, producer: Producer, suspects: Suspects) -> None:
        self._consumer, self._producer, self._suspects = consumer, producer, suspects

    def consumer(self) -> Consumer:
        return self._consumer

    def producer(self) -> Producer:
        return self._producer

    def suspects(self, producer: Any) -> Suspects:
        return self._suspects


Behaviour = Callable[[SourceCoords], Awaitable[None]]


def config(commit_interval_s: float = 0.05, **limits: Any) -> WorkerConfig:
    cfg: WorkerConfig = load_config(
        kafka={"input_topic": INPUT, "output_topic": OUTPUT, "dead_letter_topic": DLQ,
               "commit_interval_s": commit_interval_s},
        limits={"shutdown_grace_s": 5, **limits},
    )  # fmt: skip
    return cfg


class ScriptedRunner(JobRunner):
    """The real JobRunner's bookkeeping (suspects, gate) with the attempt replaced by `behave`,
    which may sleep, raise, or record who ran at once."""

    def __init__(
        self, cfg: WorkerConfig, metrics: Metrics, behave: Behaviour, engine: Any = None
    ) -> None:
        super().__init__(cfg, engine=engine, media=None, metrics=metrics)  # type: ignore[arg-type]
        self._behave = behave
        self.running: set[str] = set()
        self.max_running = 0
        self.started: list[str] = []

    async def _run(
        self, raw: bytes | None, ctx: Context, broker_ts_ms: int, isolated: bool
    ) -> Outcome:
        job_id = json.loads(raw or b"{}")["job_id"]
        async with self._gate.alone() if isolated else self._gate.shared():
            return await self._engine_step(job_id, ctx)

    async def _engine_step(self, job_id: str, ctx: Context) -> Outcome:
        self.started.append(job_id)
        self.running.add(job_id)
        self.max_running = max(self.max_running, len(self.running))
        self._in_engine[job_id] = ctx.source
        try:
            await self._behave(ctx.source)
        except EngineFatal as death:
            self._saw_death(death)
            raise
        finally:
            self.running.discard(job_id)
            del self._in_engine[job_id]
        return Outcome(OUTPUT, job_id, Result.model_construct(job_id=job_id, text="ok"))


def make_worker(
    consumer: Consumer, behave: Behaviour, producer: Producer | None = None,
    suspects: Suspects | None = None, commit_interval_s: float = 0.05, **limits: Any,
) -> tuple[Worker, ScriptedRunner, Producer, Suspects, Metrics]:  # fmt: skip
    """`commit_interval_s`: long, when a test must know that only the revoke and stop commit."""
    cfg = config(commit_interval_s, **limits)
    metrics = Metrics()
    runner = ScriptedRunner(cfg, metrics, behave)
    producer = producer or Producer()
    suspects = suspects or Suspects()
    worker = Worker(cfg, runner, metrics, "tiny", clients=Clients(consumer, producer, suspects))
    return worker, runner, producer, suspects, metrics


async def run_until(worker: Worker, done: Callable[[], bool], timeout: float = 10.0) -> int:
    """Run the loop until `done()` holds, then stop it as SIGTERM would; returns the exit code."""
    task = asyncio.create_task(worker.run())
    deadline = asyncio.get_running_loop().time() + timeout
    while not done() and not task.done():
        if asyncio.get_running_loop().time() > deadline:
            worker.request_stop()
            await task
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
    worker.request_stop()
    return await task


def failure_codes(producer: Producer) -> list[ErrorCode]:
    return [Failure.model_validate(doc).code for doc in producer.on(DLQ)]
