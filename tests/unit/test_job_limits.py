"""Per-attempt timeout vs per-job deadline, and what counts as a finished generation."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from mmworker_schemas import Failure, GenerationParams, Job, MediaRef, SourceCoords

from mmworker.engine import _check_finished
from mmworker.errors import RequestFailed
from mmworker.jobs import JobRunner
from mmworker.metrics import Metrics
from mmworker.records import Context
from tests.unit.loopkit import config

CTX = Context(SourceCoords(topic="jobs", partition=0, offset=1), None, "w", "tiny", None)
RAW = Job(job_id="slow", media=[MediaRef(uri="https://example.test/a.jpg")]).model_dump_json()


def test_a_job_too_slow_for_its_attempts_stops_at_the_job_deadline() -> None:
    """Retrying a job_timeout used to run a too-heavy job max_attempts times in full."""
    cfg = config(job_timeout_s=0.2, job_deadline_s=0.5, max_attempts=10, retry_backoff_s=0.01)
    runner = JobRunner(cfg, engine=None, media=None, metrics=Metrics())  # type: ignore[arg-type]
    attempts: list[float] = []

    async def attempt(*_a: Any) -> Any:
        attempts.append(asyncio.get_running_loop().time())
        await asyncio.sleep(10)

    runner._attempt = attempt  # type: ignore[method-assign]

    async def scenario() -> tuple[Any, float]:
        t0 = asyncio.get_running_loop().time()
        outcome = await runner.run(RAW.encode(), CTX, 0)
        return outcome, asyncio.get_running_loop().time() - t0

    outcome, took = asyncio.run(scenario())
    assert isinstance(outcome.record, Failure)
    assert outcome.record.code == "job_timeout"
    assert 1 <= len(attempts) <= 3, attempts  # not 10 (one, where a busy host fires the 0.2 s late)
    assert took < 1.5, took  # 10 x 0.2 s before
    assert "job_deadline_s" in outcome.record.message or "job exceeded" in outcome.record.message


def _choice(reason: str | None, tokens: int) -> Any:
    return SimpleNamespace(finish_reason=reason, token_ids=list(range(tokens)))


def test_only_generations_that_ended_as_asked_are_results() -> None:
    params = GenerationParams(max_tokens=10)
    _check_finished(_choice("stop", 3), params)
    _check_finished(_choice("length", 10), params)
    with pytest.raises(RequestFailed) as aborted:
        _check_finished(_choice("abort", 4), params)
    assert aborted.value.retryable is True  # redone, never published cut off
    with pytest.raises(RequestFailed) as short:
        _check_finished(_choice("length", 4), params)  # the context ran out, not max_tokens
    assert short.value.retryable is False
    with pytest.raises(RequestFailed):
        _check_finished(_choice(None, 4), params)
