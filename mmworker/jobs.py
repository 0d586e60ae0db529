"""One Kafka record → one `Result` or one `Failure`, retrying what may succeed later.

Every exception a job can raise is typed and carries its dead-letter code; anything else is a bug,
reported as `internal_error` on the dead-letter topic so the partition keeps flowing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from mmworker_preprocess.tokens import fair_shares
from mmworker_schemas import (
    Failure,
    GenerationParams,
    Job,
    Result,
    SchemaError,
    SourceCoords,
    parse_job,
)
from mmworker_schemas.codes import ErrorCode
from mmworker_schemas.errors import CodedError

from mmworker import logs
from mmworker.config import WorkerConfig
from mmworker.engine import Engine, EngineItem, EngineOutput
from mmworker.engine.guidance import Checked, GrammarChecker, parse_answer
from mmworker.errors import (
    ConfigError,
    EngineCrash,
    EngineFatal,
    ForbiddenReplyTopic,
    InvalidResponseFormat,
    JobTimeout,
    PreprocessPoolDead,
    PublishRefused,
    TooManyMedia,
    VisualBudgetExceeded,
    WorkerError,
)
from mmworker.gate import WAIT_CLOCK, EngineGate, WaitClock
from mmworker.lanes import BACKGROUND
from mmworker.media import MediaStage, PreparedMedia, TokenBudget
from mmworker.metrics import Metrics
from mmworker.records import Context, build_failure, build_result, visual_tokens
from mmworker.segmented import run_segments, segment_instruction
from mmworker.suspects import suspect_key
from mmworker.task_defaults import DEFAULT_TASKS
from mmworker.tasks import Plan, plan_job

log = logging.getLogger(__name__)

_TYPED = CodedError


@dataclass(frozen=True, slots=True)
class Outcome:
    topic: str
    key: str
    record: Result | Failure

    @property
    def kind(self) -> str:
        return "result" if isinstance(self.record, Result) else "failure"


class JobRunner:
    def __init__(
        self, cfg: WorkerConfig, engine: Engine, media: MediaStage, metrics: Metrics
    ) -> None:
        self._cfg = cfg
        self._engine = engine
        self._media = media
        self._metrics = metrics
        self._gate = EngineGate(cfg.limits.backfill_beside_live, cfg.limits.live_idle_s)
        self._grammars = GrammarChecker(cfg.structured_output, self._grammar_tokenizer)
        #: Jobs inside the engine now, by request id.
        self._in_engine: dict[str, SourceCoords] = {}
        #: The jobs that were inside the engine when it died (set once per death, by the first
        #: job to see it; the worker's suspect record forgets it).
        self.dead_with: list[SourceCoords] | None = None
        #: How many requests those jobs had inside (a segmented job has one per segment).
        self._dead_requests = 0

    async def check_tasks(self) -> None:
        """Compile the response_format of every task the config adds or changes, once the engine
        is up: a task that cannot run is a configuration error (exit 2), not a dead letter per
        job. The shipped tasks are checked by the tests, so a default worker pays nothing."""
        for name, task in self._cfg.tasks.items():
            shipped = DEFAULT_TASKS.get(name)
            if task.response_format is None or (
                shipped is not None and task == type(task)(**shipped)
            ):
                continue
            try:
                await self._grammars.check(task.response_format)
            except InvalidResponseFormat as exc:
                raise ConfigError(f"tasks.{name}.response_format: {exc.message}") from None

    # What engine recovery (`mmworker.recovery.Inside`) needs of the runner.

    def inside(self) -> int:
        return len(self._in_engine)

    def dead_inside(self) -> frozenset[str]:
        return frozenset(suspect_key(s) for s in self.dead_with or ())

    def dead_requests(self) -> int:
        return self._dead_requests if self.dead_with is not None else 0

    async def set_engine_cap(self, cap: int | None) -> None:
        await self._gate.set_cap(cap)

    async def engine_down(self) -> None:
        """Prepared jobs wait at the gate instead of meeting the dead engine."""
        await self._gate.set_down(True)

    async def engine_up(self) -> None:
        await self._gate.set_down(False)

    def _saw_death(self, death: EngineFatal) -> None:
        """The first job to see a core's death sees everyone inside it; a death of an older,
        already replaced core, or one seen once its replacement began, names no one.

        Each job once: a segmented job has several requests inside (a segment each), and one
        death counted once per request condemned it unrun after a single SIGKILL of the core."""
        current = death.epoch == getattr(self._engine, "epoch", 0)
        if self.dead_with is None and current and not self._gate.down:
            jobs = {suspect_key(s): s for s in self._in_engine.values()}
            self.dead_with = list(jobs.values())
            self._dead_requests = len(self._in_engine)

    def _grammar_tokenizer(self) -> tuple[Any, int]:
        return self._engine.grammar_tokenizer()

    async def run(
        self, raw: bytes | None, ctx: Context, broker_ts_ms: int, deaths: int = 0
    ) -> Outcome:
        """Raises only `EngineFatal` (and cancellation); every other failure becomes a record.

        `deaths`: engine deaths this record was inside before. At `limits.max_engine_deaths` it
        is dead-lettered unrun; below, but above 0, it runs alone in the engine.
        """
        limits = self._cfg.limits
        if deaths >= limits.max_engine_deaths:
            self._metrics.suspects.labels("condemned").inc()
            error = EngineCrash(
                f"the engine died {deaths} times with this job inside "
                f"(limits.max_engine_deaths = {limits.max_engine_deaths}); not run again"
            )
            job = _parsed_or_none(raw)
            return self._dead_letter(error.code, error.message, False, deaths, raw, ctx, job,
                                     job.job_id if job else None)  # fmt: skip
        if deaths:
            self._metrics.suspects.labels("isolated").inc()
            log.warning("%s was inside %d engine death(s): running it alone", ctx.source, deaths)
            return await self._run(raw, ctx, broker_ts_ms, isolated=True)
        lane = self._cfg.kafka.backfill_topic
        if lane is not None and ctx.source.topic != lane:
            async with self._gate.foreground():  # a live job, with a backfill lane beside it
                return await self._run(raw, ctx, broker_ts_ms, isolated=False)
        if lane is not None:
            BACKGROUND.set(True)  # this job's task only: it runs in a context of its own
        return await self._run(raw, ctx, broker_ts_ms, isolated=False)

    async def _run(
        self, raw: bytes | None, ctx: Context, broker_ts_ms: int, isolated: bool
    ) -> Outcome:
        limits = self._cfg.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.job_deadline_s
        gated = 0.0  # seconds waited at the engine gate: they count in neither limit (WaitClock)
        job: Job | None = None
        attempts = 0
        while True:
            attempts += 1
            timeout = min(limits.job_timeout_s, deadline + gated - loop.time())
            clock: WaitClock | None = None
            try:
                job = parse_job(raw)
                logs.bind_job(job_id=job.job_id)
                async with asyncio.timeout(timeout) as limit:
                    clock = WaitClock(limit)
                    token = WAIT_CLOCK.set(clock)
                    try:
                        result = await self._attempt(job, ctx, broker_ts_ms, isolated)
                    finally:
                        clock.close()
                        WAIT_CLOCK.reset(token)
                return Outcome(job.reply_topic or self._cfg.kafka.output_topic, job.job_id, result)
            except (EngineFatal, PreprocessPoolDead):
                raise
            except TimeoutError:
                what = "job" if timeout < limits.job_timeout_s else "attempt"
                seconds = limits.job_deadline_s if what == "job" else limits.job_timeout_s
                waited = clock.waited_s if clock is not None else 0.0
                waited += gated if what == "job" else 0.0
                note = (
                    f"; {waited:.1f}s at the engine gate or preempted not counted"
                    if waited > 0.05
                    else ""
                )
                error: Exception = JobTimeout(
                    f"{what} exceeded {seconds}s (attempt {attempts}{note})"
                )
            except _TYPED as exc:
                error = exc
            except Exception as exc:
                log.exception("unexpected error in job at %s", ctx.source)
                error = WorkerError(f"internal error: {type(exc).__name__}: {exc}")
            gated += clock.waited_s if clock is not None else 0.0
            code, message, retryable = _classify(error)
            backoff = limits.retry_backoff_s * 2 ** (attempts - 1)
            if retryable and attempts < limits.max_attempts:
                if loop.time() + backoff < deadline + gated:
                    self._metrics.retries.inc()
                    await asyncio.sleep(backoff)
                    continue
                message += f" (limits.job_deadline_s = {limits.job_deadline_s}s reached)"
            job_id = getattr(error, "job_id", None)
            return self._dead_letter(code, message, retryable, attempts, raw, ctx, job, job_id)

    def refused(
        self, outcome: Outcome, error: PublishRefused, raw: bytes | None, ctx: Context
    ) -> Outcome:
        """The dead-letter record for a result the broker would not take (see PublishRefused)."""
        message = f"result for {outcome.topic!r} refused by the broker: {error.message}"
        job_id = outcome.record.job_id
        return self._dead_letter(error.code, message, False, 1, raw, ctx, None, job_id)

    def _dead_letter(
        self, code: ErrorCode, message: str, retryable: bool, attempts: int, raw: bytes | None,
        ctx: Context, job: Job | None, job_id: str | None,
    ) -> Outcome:  # fmt: skip
        failure = build_failure(
            code=code, message=message, retryable=retryable, attempts=attempts, raw=raw,
            ctx=ctx, job=job, job_id=job_id,
        )  # fmt: skip
        src = ctx.source
        key = failure.job_id or ctx.record_key or f"{src.topic}/{src.partition}/{src.offset}"
        return Outcome(self._cfg.kafka.dead_letter_topic, key, failure)

    async def _attempt(self, job: Job, ctx: Context, broker_ts_ms: int, isolated: bool) -> Result:
        t0 = time.perf_counter()
        queue_wait_s = time.time() - broker_ts_ms / 1000 if broker_ts_ms > 0 else 0.0
        if job.reply_topic is not None and job.reply_topic not in self._cfg.kafka.reply_topics:
            raise ForbiddenReplyTopic(
                f"reply_topic {job.reply_topic!r} is not one of kafka.reply_topics "
                f"{list(self._cfg.kafka.reply_topics)}"
            )
        job, plan = plan_job(job, self._cfg.tasks)
        checked = await self._check_format(plan)
        if job.segments is not None:
            return await self._segmented(job, plan, checked, ctx, isolated, queue_wait_s, t0)
        media = await self._media.prepare(job, self._budgets(job, plan))
        self._observe_media(media)
        media = await self._share_context(job, plan, media)
        kinds = tuple(m.kind for m in media)
        instruction = plan.instruction(kinds)
        self._check_budget(job, media, instruction, kinds)
        items = [EngineItem(m.prepared, m.key) for m in media]
        background = ctx.source.topic == self._cfg.kafka.backfill_topic
        out = None
        while out is None:  # a backfill job preempted by a live one goes round again
            out = await self._generate(job, ctx, instruction, items, checked, isolated, background)
        self._metrics.stage_seconds.labels("engine").observe(out.engine_s)
        self._metrics.output_tokens.inc(out.output_tokens)
        parsed = None
        if checked is not None:
            parsed = parse_answer(
                checked.guide, out.text, out.finish_reason, job.generation.max_tokens
            )
        return build_result(
            job=job, media=media, out=out, ctx=ctx, queue_wait_s=queue_wait_s,
            total_s=time.perf_counter() - t0, parsed=parsed,
        )  # fmt: skip

    async def _segmented(
        self, job: Job, plan: Plan, checked: Checked | None, ctx: Context, isolated: bool,
        queue_wait_s: float, t0: float,
    ) -> Result:  # fmt: skip
        """Segment mode (`mmworker.segmented`): each segment and the summary go through
        `_generate` as a job's one request does, so the gate, preemption and engine deaths
        treat them alike."""
        background = ctx.source.topic == self._cfg.kafka.backfill_topic

        async def generate(
            instruction: str, items: list[EngineItem], generation: GenerationParams,
            guided: Checked | None,
        ) -> EngineOutput:  # fmt: skip
            asked = job.model_copy(update={"generation": generation})
            out = None
            while out is None:  # preempted by a live job: again, as in `_attempt`
                out = await self._generate(asked, ctx, instruction, items, guided, isolated,
                                           background)  # fmt: skip
            self._metrics.output_tokens.inc(out.output_tokens)
            return out

        params = self._media.video_params(job).with_budget(self._segment_budget(job, plan))
        result = await run_segments(
            job=job, plan=plan, checked=checked, media=self._media, params=params,
            generate=generate, ctx=ctx, queue_wait_s=queue_wait_s, t0=t0,
            count_tokens=lambda text: self._engine.prompt_tokens(text, ()),
            max_model_len=self._cfg.engine.max_model_len, observe=self._observe_segment,
            retried=self._metrics.retries.inc,
        )  # fmt: skip
        # One observation per job, as for the others: its requests' overlapping spans once.
        self._metrics.stage_seconds.labels("engine").observe(result.timings.engine_s)
        return result

    async def _generate(
        self, job: Job, ctx: Context, instruction: str, items: list[EngineItem],
        checked: Checked | None, isolated: bool, background: bool,
    ) -> EngineOutput | None:  # fmt: skip
        """One pass through the engine gate; None if a live job preempted it (`EngineGate`)."""
        request_id = (
            f"{job.job_id}@{ctx.source.partition}:{ctx.source.offset}:{time.monotonic_ns()}"
        )
        # A suspect waits for the engine to empty and holds it alone (only for its generation:
        # its fetch, decode and retry pauses do not keep the engine idle); others share it.
        gate = (
            self._gate.alone(suspect_key(ctx.source)) if isolated else self._gate.shared(background)
        )
        async with gate:
            if not self._engine.alive():
                # Dead before this request: those inside it, if any, are the suspects; this one,
                # sent to a core already dead, was counted with them.
                death = EngineFatal("the engine core had died", epoch=self._engine.epoch)
                self._saw_death(death)
                raise death
            self._in_engine[request_id] = ctx.source
            entered = asyncio.get_running_loop().time()
            call = asyncio.ensure_future(self._engine.generate(
                request_id, instruction, items, job.generation,
                guide=checked.guide if checked else None, background=background,
            ))  # fmt: skip
            if background:
                self._gate.track(call)
            try:
                return await call
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._gate.untrack(call) and not (task and task.cancelling()):
                    self._metrics.preempted.inc()
                    clock = WAIT_CLOCK.get()
                    if clock is not None:  # thrown away: it counts in no limit
                        clock.credit(since=entered)
                    return None
                raise
            except EngineFatal as death:
                self._saw_death(death)
                raise
            finally:
                self._gate.untrack(call)
                del self._in_engine[request_id]

    async def _check_format(self, plan: Plan) -> Checked | None:
        """The job's response_format, compiled (once per distinct format) before anything is
        fetched: one that cannot run costs nothing else and never reaches the engine."""
        if plan.response_format is None:
            return None
        try:
            checked = await self._grammars.check(plan.response_format)
        except InvalidResponseFormat:
            self._metrics.response_formats.labels("refused").inc()
            raise
        self._metrics.response_formats.labels(checked.how).inc()
        return checked

    def _observe_segment(self, cached: bool, seconds: float) -> None:
        self._metrics.cache.labels("hit" if cached else "miss").inc()
        self._metrics.stage_seconds.labels("preprocess").observe(seconds)

    def _observe_media(self, media: list[PreparedMedia]) -> None:
        for m in media:
            result = "hit" if m.cache_hit else "shared" if m.shared_decode else "miss"
            self._metrics.cache.labels(result).inc()
            self._metrics.stage_seconds.labels("fetch").observe(m.fetch_s)
            self._metrics.stage_seconds.labels("preprocess").observe(m.preprocess_s)

    def _segment_budget(self, job: Job, plan: Plan) -> int | None:
        """The visual tokens a segment may take: what the context leaves after the segment's
        own prompt (the job's `segments.prompt`, or the time range and the job's instruction)
        and `max_tokens`, up to `engine.max_visual_tokens_per_item`. Counted on the prompt with
        the widest time range, so every segment fits; a prompt that leaves no room is refused
        here, not sent segment by segment to an engine that fails each."""
        cfg = self._cfg.engine
        if cfg.max_model_len is None:
            return cfg.max_visual_tokens_per_item
        assert job.segments is not None
        widest = segment_instruction(job.segments, plan, 99999.9, 99999.9)
        text = self._engine.prompt_tokens(widest, ("video",))
        room = cfg.max_model_len - text - job.generation.max_tokens
        if room <= 0:
            raise VisualBudgetExceeded(
                f"a segment's prompt ({text} text tokens) plus max_tokens "
                f"{job.generation.max_tokens} leaves no room for its frames; max_model_len is "
                f"{cfg.max_model_len}"
            )
        return min(cfg.max_visual_tokens_per_item, room)

    def _budgets(self, job: Job, plan: Plan) -> list[TokenBudget]:
        """The visual tokens each item may take, fixed before anything is fetched, so a video
        that needs fitting is decoded once, at the fitted plan (see the fitting rule in
        preprocess.video `_fit`).

        Each item may take what the context leaves after the prompt's text and `max_tokens`,
        up to `engine.max_visual_tokens_per_item`. The text depends on the kinds, which are
        sniffed later: for one item it is counted for each kind, exactly; for several, for the
        cheapest mix containing the item's kind, so this pass never fits an item that the job's
        exact count would let through. Splitting the context among several items is
        `_share_context`'s, once their needs are known.
        """
        cfg = self._cfg.engine
        per_item = cfg.max_visual_tokens_per_item
        if cfg.max_model_len is None:
            return [TokenBudget(per_item, per_item)] * len(job.media)
        n = len(job.media)
        left: dict[str, int | None] = {}
        for kind in ("image", "video"):
            mixes = [(kind,) * n] + ([("image",) + ("video",) * (n - 1)] if n > 1 else [])
            text = min(self._engine.prompt_tokens(plan.instruction(m), m) for m in mixes)
            room = cfg.max_model_len - text - job.generation.max_tokens
            # No room at all: nothing to fit to; the final check refuses it with the numbers.
            left[kind] = min(per_item, room) if room > 0 else None
        return [TokenBudget(left["image"], left["video"])] * n

    async def _share_context(
        self, job: Job, plan: Plan, media: list[PreparedMedia]
    ) -> list[PreparedMedia]:
        """Fit a job whose items each fit but together overflow the context: max-min fair shares.

        Items needing no more than an equal share of what is left keep what they have; the
        others share the rest equally and are prepared again at that share (fetched again: the
        bytes are not kept; only jobs with several items that overflow pay it). See
        `mmworker_preprocess.tokens.fair_shares`.
        """
        cfg = self._cfg.engine
        if cfg.max_model_len is None or len(media) < 2:
            return media  # one item was fitted to the exact room already
        kinds = tuple(m.kind for m in media)
        self._check_counts(kinds)
        text = self._engine.prompt_tokens(plan.instruction(kinds), kinds)
        capacity = cfg.max_model_len - text - job.generation.max_tokens
        needs = [visual_tokens(m) for m in media]
        shares = fair_shares(needs, capacity)
        over = [
            i for i, (need, share) in enumerate(zip(needs, shares, strict=True)) if need > share
        ]
        if not over or capacity <= 0:
            return media
        log.info(
            "job %s: %d visual tokens for %d left of the context; fitting item(s) %s to %s",
            job.job_id, sum(needs), capacity, over, [shares[i] for i in over],
        )  # fmt: skip
        subset = job.model_copy(update={"media": [job.media[i] for i in over]})
        refit = await self._media.prepare(subset, [TokenBudget(shares[i], shares[i]) for i in over])
        self._observe_media(refit)
        fitted = list(media)
        for i, item in zip(over, refit, strict=True):
            fitted[i] = item
        return fitted

    def _check_counts(self, kinds: tuple[str, ...]) -> None:
        for kind, count in Counter(kinds).items():
            limit = self._cfg.engine.limit_mm_per_prompt.get(kind, 0)
            if count > limit:
                raise TooManyMedia(f"{count} {kind} items; this worker takes at most {limit}")

    def _check_budget(
        self, job: Job, media: list[PreparedMedia], instruction: str, kinds: tuple[str, ...]
    ) -> None:
        """Refuse what the engine would fail on, before it is submitted (vLLM #34040).

        After fitting this holds unless fitting could not help: no room left after the text
        and `max_tokens`, or an item whose decoded frames were larger than announced.
        """
        engine_cfg = self._cfg.engine
        self._check_counts(kinds)
        per_item = [visual_tokens(m) for m in media]
        worst = max(per_item, default=0)
        if worst > engine_cfg.max_visual_tokens_per_item:
            raise VisualBudgetExceeded(
                f"an item needs {worst} visual tokens; the limit is "
                f"{engine_cfg.max_visual_tokens_per_item}"
            )
        if engine_cfg.max_model_len is not None:
            text = self._engine.prompt_tokens(instruction, kinds)
            need = text + sum(per_item) + job.generation.max_tokens
            if need > engine_cfg.max_model_len:
                raise VisualBudgetExceeded(
                    f"prompt ({text} text + {sum(per_item)} visual tokens) plus max_tokens "
                    f"{job.generation.max_tokens} is {need}; max_model_len is "
                    f"{engine_cfg.max_model_len}"
                )


def _parsed_or_none(raw: bytes | None) -> Job | None:
    try:
        return parse_job(raw)
    except SchemaError:
        return None


def _classify(error: Exception) -> tuple[ErrorCode, str, bool]:
    if isinstance(error, _TYPED):
        return error.code, error.message, error.retryable
    return ErrorCode.INTERNAL_ERROR, str(error), False
