"""The poll loop against in-memory clients: backpressure, commit cadence, rebalances, suspects
and every fatal path. The integration tests cover the same against the real broker and engine;
here each rule is pinned down exactly and fast."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from kafka.errors import KafkaConnectionError, MessageSizeTooLargeError, UnknownError
from mmworker_schemas import SourceCoords
from mmworker_schemas.codes import ErrorCode

from mmworker.errors import EngineFatal
from mmworker.exits import ExitCode
from mmworker.jobs import JobRunner
from mmworker.metrics import Metrics
from mmworker.offsets import TopicPartition
from mmworker.suspects import suspect_key
from tests.unit.loopkit import (
    DLQ,
    INPUT,
    OUTPUT,
    Consumer,
    Producer,
    Suspects,
    config,
    failure_codes,
    make_worker,
    run_until,
)

P0, P1 = TopicPartition(INPUT, 0), TopicPartition(INPUT, 1)


def src(partition: int, offset: int) -> SourceCoords:
    return SourceCoords(topic=INPUT, partition=partition, offset=offset)


def test_backpressure_bounds_held_jobs_and_everything_is_answered_and_committed() -> None:
    consumer = Consumer({0: 60, 1: 60})
    held: list[int] = []

    async def behave(_s: SourceCoords) -> None:
        held.append(worker.held())
        await asyncio.sleep(0.005)

    worker, _, producer, _, metrics = make_worker(consumer, behave, max_in_flight=8)
    code = asyncio.run(run_until(worker, lambda: consumer.committed() == {P0: 60, P1: 60}))

    assert code == ExitCode.OK
    assert len(producer.on(OUTPUT)) == 120
    assert max(held) <= 8, max(held)
    assert max(consumer.max_records_seen) <= 8  # never asks for more than there is room for
    assert any(m < 8 for m in consumer.max_records_seen)
    assert metrics.jobs.labels("result")._value.get() == 120


def test_commit_waits_for_the_lowest_unfinished_offset() -> None:
    consumer = Consumer({0: 10})
    release = asyncio.Event()

    async def behave(s: SourceCoords) -> None:
        if s.offset == 0:
            await release.wait()

    worker, _, producer, _, _ = make_worker(consumer, behave)

    async def scenario() -> int:
        task = asyncio.create_task(worker.run())
        while len(producer.on(OUTPUT)) < 9:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # several commit intervals
        assert consumer.committed().get(P0) is None  # offsets 1-9 done, 0 not: nothing to commit
        release.set()
        while consumer.committed().get(P0) != 10:
            await asyncio.sleep(0.01)
        worker.request_stop()
        return await task

    assert asyncio.run(scenario()) == ExitCode.OK


def test_a_stop_asked_while_the_poll_is_planned_takes_no_more_records() -> None:
    """The stop (a signal, or a job's fatal end) lands while the loop plans its pauses, after
    the loop's check: the poll that followed took records only to drain them, or, after a fatal
    end, started them past `max_in_flight` to be abandoned."""
    consumer = Consumer({0: 50})

    async def behave(_s: SourceCoords) -> None:
        await asyncio.sleep(0.01)

    worker, _, _, _, _ = make_worker(consumer, behave)
    polls_at_stop: list[int] = []
    real_paused = consumer.paused

    async def scenario() -> int:
        loop = asyncio.get_running_loop()

        def paused() -> set[TopicPartition]:  # on the Kafka thread, inside the loop's planning
            if len(consumer.max_records_seen) >= 2 and not polls_at_stop:
                polls_at_stop.append(len(consumer.max_records_seen))
                loop.call_soon_threadsafe(worker.request_stop)
                time.sleep(0.2)  # the stop is in before the planning returns
            return real_paused()

        consumer.paused = paused  # type: ignore[method-assign]
        return await worker.run()

    assert asyncio.run(scenario()) == ExitCode.OK
    assert polls_at_stop and len(consumer.max_records_seen) == polls_at_stop[0]


@pytest.mark.parametrize("how", ["revoke", "lose"])
def test_giving_up_a_partition_cancels_its_jobs_and_commits_only_on_revoke(how: str) -> None:
    consumer = Consumer({0: 4, 1: 4})
    blocked = asyncio.Event()

    async def behave(s: SourceCoords) -> None:
        if s.partition == 1 and s.offset >= 2:
            await blocked.wait()  # never set: these are in flight when the partition goes

    # No periodic commit: one landing before the rebalance would commit p1's done offsets
    # itself, and the revoke's commit (or the loss's lack of one) would go unseen.
    worker, _, producer, _, _ = make_worker(consumer, behave, commit_interval_s=3600)

    async def scenario() -> int:
        task = asyncio.create_task(worker.run())
        # p0: 0-3 and p1: 0-1 answered and their tasks ended; p1: 2-3 still running.
        while len(producer.on(OUTPUT)) < 6 or worker.in_flight > 2:
            await asyncio.sleep(0.01)
        assert worker.in_flight == 2
        consumer.pending_rebalance = (how, [P1])
        while worker.in_flight:
            await asyncio.sleep(0.01)
        worker.request_stop()
        return await task

    assert asyncio.run(scenario()) == ExitCode.OK
    assert len(producer.on(OUTPUT)) == 6  # the cancelled two published nothing
    committed = consumer.committed()
    assert committed[P0] == 4
    if how == "revoke":
        assert committed[P1] == 2  # what was done, synchronously, before letting go
        assert consumer.commits[0] == {P1: 2}  # by the revoke, before the stop's commit
    else:
        assert P1 not in committed  # lost: another member owns it, commit nothing


def test_a_partition_lost_and_reassigned_in_one_poll_keeps_every_running_job_counted() -> None:
    """The cancelled jobs of the lost partition end after their redelivered twins started under
    the same keys: ending must not remove the twins from the registry."""
    consumer = Consumer({0: 2})
    gate = asyncio.Event()
    ran: list[SourceCoords] = []

    async def behave(s: SourceCoords) -> None:
        ran.append(s)
        await gate.wait()

    worker, _, producer, _, _ = make_worker(consumer, behave)

    async def scenario() -> int:
        task = asyncio.create_task(worker.run())
        while len(ran) < 2:
            await asyncio.sleep(0.01)
        consumer.pending_rebalance = ("lose+assign", [P0])
        while len(ran) < 4:  # both redelivered and running again
            await asyncio.sleep(0.01)
        for _ in range(100):  # the cancelled originals end; their twins must stay counted
            await asyncio.sleep(0.01)
        assert worker.in_flight == 2, worker.in_flight
        gate.set()
        while consumer.committed().get(P0) != 2:
            await asyncio.sleep(0.01)
        worker.request_stop()
        return await task

    assert asyncio.run(scenario()) == ExitCode.OK
    assert len(producer.on(OUTPUT)) == 2


def test_engine_death_stops_uncommitted_and_records_everyone_inside_as_suspects() -> None:
    consumer = Consumer({0: 3, 1: 3})
    inside = asyncio.Event()
    entered: list[SourceCoords] = []

    async def behave(s: SourceCoords) -> None:
        entered.append(s)
        if len(entered) == 6:
            inside.set()
        await inside.wait()
        if s == src(1, 2):
            raise EngineFatal("engine died: test")
        await asyncio.sleep(10)

    worker, _, producer, suspects, _ = make_worker(consumer, behave)
    code = asyncio.run(run_until(worker, lambda: worker.fatal is not None))

    assert code == ExitCode.ENGINE_DEAD
    assert producer.on(OUTPUT) == [] and consumer.commits == []
    (recorded,) = suspects.recorded
    assert sorted(recorded, key=lambda s: (s.partition, s.offset)) == sorted(
        entered, key=lambda s: (s.partition, s.offset)
    )
    assert consumer.closed and producer.flushed and producer.closed


def test_an_engine_death_during_the_drain_still_records_everyone_inside_as_suspects() -> None:
    """SIGTERM, then the engine dies while the jobs inside it drain. Without a recovery (the
    processes of a shared engine core, whose supervisor replaces them), the suspects were
    recorded only for a death before the stop: a query of death that killed the engine during a
    drain ran in a batch again after the restart, its death uncounted."""
    consumer = Consumer({0: 3, 1: 3})
    inside, dies = asyncio.Event(), asyncio.Event()
    entered: list[SourceCoords] = []

    async def behave(s: SourceCoords) -> None:
        entered.append(s)
        if len(entered) == 6:
            inside.set()
        await dies.wait()
        raise EngineFatal("engine died: test")

    worker, _, producer, suspects, _ = make_worker(consumer, behave)

    async def scenario() -> int:
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(inside.wait(), 10)
        worker.request_stop()
        await asyncio.sleep(0.1)  # draining
        dies.set()
        return await task

    assert asyncio.run(scenario()) == ExitCode.ENGINE_DEAD
    assert producer.on(OUTPUT) == [] and consumer.commits == []
    (recorded,) = suspects.recorded
    assert sorted(recorded, key=lambda s: (s.partition, s.offset)) == sorted(
        entered, key=lambda s: (s.partition, s.offset)
    )


def test_a_job_at_max_engine_deaths_is_dead_lettered_unrun_and_the_partition_moves_on() -> None:
    consumer = Consumer({0: 5})
    suspects = Suspects({suspect_key(src(0, 2)): 2})

    async def behave(_s: SourceCoords) -> None:
        await asyncio.sleep(0)

    worker, runner, producer, _, metrics = make_worker(consumer, behave, suspects=suspects)
    assert asyncio.run(run_until(worker, lambda: consumer.committed() == {P0: 5})) == 0

    assert "p0-o2" not in runner.started
    assert failure_codes(producer) == [ErrorCode.ENGINE_CRASH]
    (failure,) = producer.on(DLQ)
    assert failure["retryable"] is False and failure["job_id"] == "p0-o2"
    assert failure["source"] == {"topic": INPUT, "partition": 0, "offset": 2}
    # Kept: a redelivery before the commit must be condemned again, not run.
    assert suspects.cleared == [] and suspects.deaths(src(0, 2)) == 2
    assert metrics.suspects.labels("condemned")._value.get() == 1


def test_a_suspect_runs_alone_and_is_cleared_when_it_finishes() -> None:
    consumer = Consumer({0: 6, 1: 6})
    suspects = Suspects({suspect_key(src(1, 3)): 1})
    alone_with: list[set[str]] = []

    async def behave(s: SourceCoords) -> None:
        if s == src(1, 3):
            alone_with.append(set(runner.running))
        await asyncio.sleep(0.02)

    worker, runner, producer, _, _ = make_worker(consumer, behave, suspects=suspects)
    done = {P0: 6, P1: 6}
    assert asyncio.run(run_until(worker, lambda: consumer.committed() == done)) == 0

    assert alone_with == [{"p1-o3"}]
    assert runner.max_running > 1  # the others did share the engine
    assert len(producer.on(OUTPUT)) == 12
    assert suspects.cleared == [suspect_key(src(1, 3))]


def test_refused_dead_letter_stops_with_exit_4() -> None:
    too_big = MessageSizeTooLargeError("too big")
    producer = Producer({OUTPUT: [too_big], DLQ: [too_big]})
    consumer = Consumer({0: 1})

    async def behave(_s: SourceCoords) -> None:
        return None

    worker, *_ = make_worker(consumer, behave, producer=producer)
    assert asyncio.run(run_until(worker, lambda: worker.fatal is not None)) == 4
    assert consumer.commits == []


def test_an_unexpected_error_in_a_job_task_stops_the_worker_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A non-Kafka error from producer.send used to end the task silently: its offset pending
    forever, the partition never committed again, the worker heartbeating as healthy."""

    class Broken(Producer):
        def send(self, topic: str, **kwargs: Any) -> Any:
            raise ValueError("serializer bug")

    consumer = Consumer({0: 2})

    async def behave(_s: SourceCoords) -> None:
        return None

    worker, *_ = make_worker(consumer, behave, producer=Broken())
    code = asyncio.run(run_until(worker, lambda: worker.fatal is not None))

    assert code == ExitCode.INTERNAL
    assert "failed unexpectedly" in caplog.text and "serializer bug" in caplog.text
    assert consumer.commits == [] and consumer.closed


def test_a_poll_error_still_shuts_down_cleanly() -> None:
    """kafka-python re-raises a rebalance listener's exception from poll()."""
    consumer = Consumer({0: 0})
    consumer.poll_error = RuntimeError("listener blew up")

    async def behave(_s: SourceCoords) -> None:
        return None

    worker, _, producer, _, _ = make_worker(consumer, behave)
    assert asyncio.run(worker.run()) == ExitCode.INTERNAL
    assert consumer.closed and producer.flushed and producer.closed


def test_a_lost_connection_raised_by_poll_is_polled_through() -> None:
    """kafka-python raised KafkaConnectionError (ECONNREFUSED) out of poll() while a broker
    restarted, and the worker exited 5: a retriable client error is polled through, and the
    jobs are answered once the connection is back; a non-retriable one still stops it."""
    consumer = Consumer({0: 3})
    consumer.poll_error = KafkaConnectionError("111 ECONNREFUSED")

    async def behave(_s: SourceCoords) -> None:
        return None

    worker, _, producer, _, _ = make_worker(consumer, behave)

    async def scenario() -> int:
        task = asyncio.create_task(worker.run())
        await asyncio.sleep(1.2)  # two retries at least
        assert not task.done() and worker.fatal is None
        consumer.poll_error = None  # the broker is back
        for _ in range(500):
            if len(producer.on(OUTPUT)) == 3:
                break
            await asyncio.sleep(0.01)
        worker.request_stop()
        return await task

    assert asyncio.run(scenario()) == ExitCode.OK
    assert len(producer.on(OUTPUT)) == 3

    consumer = Consumer({0: 1})
    consumer.poll_error = UnknownError("not retriable")
    worker, *_ = make_worker(consumer, behave)
    assert asyncio.run(worker.run()) == ExitCode.INTERNAL


def test_shutdown_grace_expiry_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    consumer = Consumer({0: 2})

    async def behave(_s: SourceCoords) -> None:
        await asyncio.sleep(30)

    worker, *_ = make_worker(consumer, behave, shutdown_grace_s=0.1)
    code = asyncio.run(run_until(worker, lambda: worker.in_flight == 2))
    assert code == ExitCode.OK
    assert "abandoning 2 jobs" in caplog.text
    assert consumer.commits == []


def test_each_dead_lettered_job_is_one_warning_naming_its_offset_and_code(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator reading the log sees every dead-lettered job once, with where it came from
    and why, without reading the dead-letter topic."""
    consumer = Consumer({0: 3})
    consumer.logs[P0][1].value = b"{not json"

    async def behave(_s: SourceCoords) -> None:
        return None

    worker, runner, producer, _, _ = make_worker(consumer, behave)
    scripted = runner._run

    async def run_or_parse(raw: bytes | None, ctx: Any, ts: int, isolated: bool) -> Any:
        if raw == b"{not json":  # the real path: parse_job refuses it before any engine step
            return await JobRunner._run(runner, raw, ctx, ts, isolated)
        return await scripted(raw, ctx, ts, isolated)

    monkeypatch.setattr(runner, "_run", run_or_parse)
    with caplog.at_level(logging.INFO, logger="mmworker"):
        code = asyncio.run(run_until(worker, lambda: consumer.committed() == {P0: 3}))

    assert code == ExitCode.OK
    assert failure_codes(producer) == [ErrorCode.INVALID_JSON]
    assert len(producer.on(OUTPUT)) == 2
    lines = [r for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert [(r.name, r.levelno) for r in lines] == [("mmworker.worker", logging.WARNING)]
    line = lines[0].getMessage()
    assert "partition=0" in line and "offset=1" in line and "code=invalid_json" in line, line
    assert "not JSON" in line, line  # the failure's message, not only its code


def test_a_job_with_several_requests_inside_a_death_is_one_suspect_with_one_death() -> None:
    """A segmented job has a request per segment inside the engine; the death is one for it."""

    class Engine:
        epoch = 0

    runner = JobRunner(config(), engine=Engine(), media=None, metrics=Metrics())  # type: ignore[arg-type]
    long_video, image = src(0, 5), src(1, 2)
    runner._in_engine.update(
        {"seg-0": long_video, "seg-1": long_video, "img": image, "seg-2": long_video}
    )
    runner._saw_death(EngineFatal("engine died: test"))
    assert runner.dead_with == [long_video, image]
    assert runner.dead_inside() == {suspect_key(long_video), suspect_key(image)}
    assert runner.dead_requests() == 4  # what the engine cap after a load death counts
