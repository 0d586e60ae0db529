"""Structured results (#16): tasks, response_format checked before the engine, parsed answers.

The grammar checks here compile with the real xgrammar against the tiny model's real tokenizer;
only the engine's generation is replaced (tests/integration/test_structured_e2e.py runs the real
one). What is pinned: precedence of job, task and defaults; every way a response_format is
refused (limits, compilation, settings that would cut the answer) is `invalid_response_format`,
decided before anything is fetched and compiled once per distinct format; a guided answer is a
result only when it is complete.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mmworker_schemas import (
    DEFAULT_PROMPTS,
    ChoiceFormat,
    ErrorCode,
    Failure,
    Job,
    JsonSchemaFormat,
    RegexFormat,
    Result,
    SourceCoords,
    parse_job,
)
from mmworker_schemas.errors import InvalidSchema
from pydantic import ValidationError

from mmworker.cache import DiskFeatureCache
from mmworker.config import PreprocessConfig, StructuredOutputConfig, WorkerConfig, load_config
from mmworker.devkit.samples import sample_image
from mmworker.devkit.tiny_model import build_tiny_model
from mmworker.engine import EngineOutput
from mmworker.engine.guidance import (
    ENGINE_STRUCTURED_OUTPUTS,
    GrammarChecker,
    Guide,
    parse_answer,
    sampling_kwargs,
    schema_depth,
)
from mmworker.errors import IncompleteOutput, InvalidResponseFormat, UnknownTask
from mmworker.jobs import JobRunner
from mmworker.media import MediaStage
from mmworker.metrics import Metrics
from mmworker.records import Context
from mmworker.task_defaults import DEFAULT_TASKS
from mmworker.tasks import plan_job
from mmworker.tools import fields, summarise
from tests.unit.loopkit import config

TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
    "required": ["tags"],
}
#: xgrammar cannot resolve the reference: the engine would fail on it.
UNRESOLVED = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}


def _job(**kw: Any) -> Job:
    return Job(job_id="j", media=[{"data": sample_image(seed=1)}], **kw)


def _schema(schema: dict[str, Any]) -> JsonSchemaFormat:
    return JsonSchemaFormat(type="json_schema", schema=schema)


# --- the wire contract ---------------------------------------------------------------------------


def test_response_format_kinds_parse_and_keep_their_wire_names() -> None:
    raw = {"job_id": "j", "media": [{"uri": "https://example.com/a.jpg"}], "task": "tags"}
    for fmt in (
        {"type": "json_schema", "schema": TAGS},
        {"type": "regex", "regex": "[A-Z]{3}"},
        {"type": "choice", "choices": ["yes", "no"]},
    ):
        job = parse_job(json.dumps({**raw, "response_format": fmt}).encode())
        assert job.task == "tags"
        assert json.loads(job.model_dump_json())["response_format"] == fmt
    job = parse_job(json.dumps({**raw, "response_format": {"type": "json_schema", "schema": TAGS}}))
    assert isinstance(job.response_format, JsonSchemaFormat) and job.response_format.schema_ == TAGS


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "xml"},
        {"type": "regex"},
        {"type": "regex", "regex": ""},
        {"type": "choice", "choices": []},
        {"type": "json_schema", "schema": "not an object"},
    ],
)
def test_malformed_response_format_is_invalid_schema(fmt: dict[str, Any]) -> None:
    raw = {"job_id": "j", "media": [{"uri": "https://example.com/a.jpg"}], "response_format": fmt}
    with pytest.raises(InvalidSchema):
        parse_job(json.dumps(raw).encode())


def test_task_name_is_bounded() -> None:
    raw = {"job_id": "j", "media": [{"uri": "https://example.com/a.jpg"}], "task": "x y"}
    with pytest.raises(InvalidSchema):
        parse_job(json.dumps(raw).encode())


def test_result_carries_json_under_its_wire_name() -> None:
    doc = {
        "job_id": "j", "text": '{"tags":["cat"]}', "task": "tags", "json": {"tags": ["cat"]},
        "finish_reason": "stop", "model": "m", "media": [], "cache_hit": False,
        "worker_id": "w", "source": {"topic": "t", "partition": 0, "offset": 0},
        "usage": {"prompt_tokens": 1, "visual_tokens": 0, "output_tokens": 1},
        "timings": {"queue_wait_s": 0, "fetch_s": 0, "preprocess_s": 0, "engine_s": 0,
                    "total_s": 0},
    }  # fmt: skip
    result = Result.model_validate_json(json.dumps(doc))
    assert result.json_ == {"tags": ["cat"]} and result.task == "tags"
    wire = json.loads(result.model_dump_json())
    assert wire["json"] == {"tags": ["cat"]} and "json_" not in wire
    # A 1.3 consumer's record (no json, no task) still reads.
    old = {k: v for k, v in doc.items() if k not in ("json", "task")}
    assert Result.model_validate(old).json_ is None


# --- tasks ---------------------------------------------------------------------------------------


def test_shipped_tasks_and_configured_ones_merge() -> None:
    cfg = load_config(tasks={"tags": {"prompt": "mine"}, "plates": {"prompt": "Read the plate."}})
    assert set(DEFAULT_TASKS) < set(cfg.tasks) and "plates" in cfg.tasks
    assert cfg.tasks["tags"].prompt == "mine" and cfg.tasks["tags"].response_format is None
    assert cfg.tasks["summary"].response_format is not None


@pytest.mark.parametrize(
    "tasks",
    [
        {"bad name": {"prompt": "p"}},
        {"t": {"prompt": {"image": "only one kind"}}},
        {"t": {"prompt": "p", "response_format": {"type": "regex"}}},
        {"t": {}},
    ],
)
def test_bad_task_config_is_refused(tasks: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        load_config(tasks=tasks)


def test_a_job_without_task_or_format_runs_as_before() -> None:
    job = _job()
    same, plan = plan_job(job, load_config().tasks)
    assert same is job and plan.response_format is None
    for kinds in (["image"], ["video"], ["image", "video"]):
        assert plan.instruction(kinds) == job.instruction(kinds)


def test_precedence_job_then_task_then_default() -> None:
    tasks = load_config().tasks
    job, plan = plan_job(_job(task="tags"), tasks)
    assert plan.instruction(["image"]).startswith("List up to 10 short tags") and (
        "this image." in plan.instruction(["image"])
    )
    assert "this images and videos." in plan.instruction(["image", "video"])
    assert plan.response_format == tasks["tags"].response_format
    assert job.generation.max_tokens == tasks["tags"].max_tokens  # the job set none

    own = RegexFormat(type="regex", regex="[a-z]+")
    job, plan = plan_job(
        _job(task="tags", prompt="Mine.", response_format=own, generation={"max_tokens": 7}),
        tasks,
    )
    assert plan.instruction(["video"]) == "Mine." and plan.response_format == own
    assert job.generation.max_tokens == 7

    _, plan = plan_job(_job(task="caption"), tasks)
    assert plan.instruction(["video"]) == DEFAULT_PROMPTS["video"]
    assert plan.response_format is None


def test_unknown_task_and_answer_cutting_settings_are_refused() -> None:
    tasks = load_config().tasks
    with pytest.raises(UnknownTask, match="'nope' is not one of this worker's tasks"):
        plan_job(_job(task="nope"), tasks)
    with pytest.raises(InvalidResponseFormat, match="ignore_eos"):
        plan_job(_job(task="tags", generation={"ignore_eos": True}), tasks)
    with pytest.raises(InvalidResponseFormat, match="stop"):
        plan_job(_job(response_format=_schema(TAGS), generation={"stop": ["}"]}), tasks)
    # Without a response_format both stay what they were.
    plan_job(_job(task="caption", generation={"ignore_eos": True, "stop": ["."]}), tasks)


# --- answers -------------------------------------------------------------------------------------


def test_a_guided_answer_is_a_result_only_when_complete() -> None:
    guide = Guide.of(_schema(TAGS))
    assert parse_answer(guide, '{"tags":["cat"]}', "stop", 10) == {"tags": ["cat"]}
    # xgrammar lets raw control characters into strings: read, not refused.
    assert parse_answer(guide, '{"t":"a\x1fb"}', "stop", 10) == {"t": "a\x1fb"}
    with pytest.raises(IncompleteOutput, match="reached max_tokens \\(10\\)"):
        parse_answer(guide, '{"tags":["ca', "length", 10)
    with pytest.raises(IncompleteOutput, match="not complete JSON"):
        parse_answer(guide, '{"tags":', "stop", 10)
    assert parse_answer(Guide.of(RegexFormat(type="regex", regex="a+")), "aaa", "stop", 5) is None


def test_guides_are_sent_in_one_canonical_form() -> None:
    a = Guide.of(_schema({"type": "object", "required": ["x"], "properties": {"x": {}}}))
    b = Guide.of(
        _schema(json.loads('{ "type" : "object", "required":["x"], "properties":{"x":{}}}'))
    )
    assert a == b and a.spec == '{"type":"object","required":["x"],"properties":{"x":{}}}'
    kwargs = sampling_kwargs(Guide.of(ChoiceFormat(type="choice", choices=["yes", "no"])))
    assert kwargs["structured_outputs"].choice == ["yes", "no"]
    assert sampling_kwargs(None) == {}
    assert ENGINE_STRUCTURED_OUTPUTS == {"backend": "xgrammar", "disable_any_whitespace": True}


def test_tail_shows_the_parsed_fields() -> None:
    doc = {"job_id": "j", "task": "tags", "json": {"tags": ["cat", "dog"], "n": 2}, "text": "x",
           "media": [{"kind": "image"}], "metadata": {"source": "/p/cat.jpg"}}  # fmt: skip
    line = summarise("out", doc)
    assert line == '[out] /p/cat.jpg (job j) [image] tags: tags=["cat","dog"] n=2'
    assert fields(["a"] * 100, width=20).endswith("…") and len(fields(["a"] * 100, width=20)) == 20
    plain = summarise("out", {"job_id": "j", "text": "a caption", "media": []})
    assert plain == "[out] j []: 'a caption'"


# --- the grammar check, on the real xgrammar and the tiny tokenizer ------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, int]:
    from transformers import AutoTokenizer

    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    vocab = json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]
    return AutoTokenizer.from_pretrained(model), int(vocab)


def _checker(tokenizer: tuple[Any, int], **cfg: Any) -> tuple[GrammarChecker, list[int]]:
    calls: list[int] = []

    def source() -> tuple[Any, int]:
        calls.append(1)
        return tokenizer

    return GrammarChecker(StructuredOutputConfig(**cfg), source), calls


def test_every_shipped_task_compiles(tokenizer: tuple[Any, int]) -> None:
    checker, _ = _checker(tokenizer)
    formats = [t.response_format for t in load_config().tasks.values() if t.response_format]
    assert len(formats) == 5

    async def check_all() -> list[str]:
        return [(await checker.check(f)).how for f in formats]

    assert asyncio.run(check_all()) == ["compiled"] * 5


@pytest.mark.parametrize(
    ("fmt", "why"),
    [
        (_schema(UNRESOLVED), "does not compile: .*missing"),
        (_schema({"type": "integer-ish"}), "does not compile"),
        # vLLM's own check: xgrammar would ignore uniqueItems, so vLLM refuses it.
        (_schema({"type": "array", "uniqueItems": True}), "not supported by xgrammar"),
        (RegexFormat(type="regex", regex="(?<=a)b"), "does not compile: .*Lookbehind"),
        (
            _schema({"properties": {"a": {"items": {"items": {"items": {}}}}}}),
            "nests 6 levels.*max_schema_depth",
        ),
        (ChoiceFormat(type="choice", choices=["x" * 1000] * 20), "bytes.*max_schema_bytes"),
    ],
)
def test_what_cannot_run_is_refused_with_the_reason(
    tokenizer: tuple[Any, int], fmt: Any, why: str
) -> None:
    checker, _ = _checker(tokenizer, max_schema_depth=5)
    with pytest.raises(InvalidResponseFormat, match=why) as info:
        asyncio.run(checker.check(fmt))
    assert info.value.code == ErrorCode.INVALID_RESPONSE_FORMAT and not info.value.retryable


def test_each_distinct_format_compiles_once_even_in_a_burst(tokenizer: tuple[Any, int]) -> None:
    checker, calls = _checker(tokenizer)
    compiled: list[Guide] = []
    real = checker._verdict

    def counting(guide: Guide) -> str | None:
        compiled.append(guide)
        return real(guide)

    checker._verdict = counting  # type: ignore[method-assign]

    async def burst() -> list[str]:
        first = await asyncio.gather(*(checker.check(_schema(TAGS)) for _ in range(50)))
        bad = [checker.check(_schema(UNRESOLVED)) for _ in range(20)]
        refused = await asyncio.gather(*bad, return_exceptions=True)
        assert all(isinstance(r, InvalidResponseFormat) for r in refused)
        again = await checker.check(_schema(json.loads(json.dumps(TAGS))))
        return [c.how for c in first] + [again.how]

    hows = asyncio.run(burst())
    assert hows.count("compiled") == 1 and hows.count("cached") == 50
    assert len(compiled) == 2  # TAGS once, UNRESOLVED once: refusals are remembered too
    assert calls == [1]  # the tokenizer tables are built once, at the first compile


def test_a_compile_past_the_time_limit_is_refused_and_remembered(
    tokenizer: tuple[Any, int],
) -> None:
    checker, _ = _checker(tokenizer, compile_timeout_s=0.2)
    slow: list[float] = []

    def stuck(guide: Guide) -> str | None:
        slow.append(time.monotonic())
        time.sleep(1.0)
        return None

    checker._verdict = stuck  # type: ignore[method-assign]

    async def twice() -> float:
        t0 = time.monotonic()
        for _ in range(2):
            with pytest.raises(InvalidResponseFormat, match=r"longer than 0\.2s"):
                await checker.check(_schema(TAGS))
        return time.monotonic() - t0

    # Timed inside the loop: asyncio.run's exit then waits for the stuck thread's sleep, and on a
    # loaded machine (a fast-tier run at load average 13) that pushed the whole call past 0.9 s.
    took = asyncio.run(twice())
    assert len(slow) == 1 and took < 1.5  # two stuck compiles: 2 s


def test_building_the_tokenizer_tables_does_not_count_in_a_schemas_limit(
    tokenizer: tuple[Any, int],
) -> None:
    """The tables are built once per process, at the first compile (seconds for a large
    vocabulary, more on a loaded host). Inside the schema's limit, that first schema timed out
    and was refused for good."""

    def slow_source() -> tuple[Any, int]:
        time.sleep(0.6)
        return tokenizer

    checker = GrammarChecker(StructuredOutputConfig(compile_timeout_s=0.4), slow_source)
    assert asyncio.run(checker.check(_schema(TAGS))).how == "compiled"


def test_schema_depth_counts_objects_and_lists() -> None:
    assert schema_depth("x") == 0 and schema_depth({}) == 1 and schema_depth({"a": [{}]}) == 3
    deep: Any = {}
    for _ in range(5000):  # no recursion limit
        deep = {"items": deep}
    assert schema_depth(deep) == 5001


# --- through the job runner: refused before anything is fetched ---------------------------------


class _GuidedEngine:
    """Answers with a scripted text; records what it was asked."""

    epoch = 0

    def alive(self) -> bool:
        return True

    def __init__(self, tokenizer: tuple[Any, int], text: str, finish: str = "stop") -> None:
        self._tokenizer = tokenizer
        self._text = text
        self._finish = finish
        self.asked: list[tuple[str, Guide | None]] = []

    def grammar_tokenizer(self) -> tuple[Any, int]:
        return self._tokenizer

    def prompt_tokens(self, instruction: str, kinds: tuple[str, ...]) -> int:
        return 30

    async def generate(
        self,
        request_id: str,
        instruction: str,
        items: list[Any],
        params: Any,
        guide: Any = None,
        background: bool = False,
    ) -> EngineOutput:
        self.asked.append((instruction, guide))
        return EngineOutput(self._text, self._finish, 100, params.max_tokens, 0.01)


CTX = Context(SourceCoords(topic="jobs", partition=0, offset=1), None, "w", "tiny", None)


def _run(engine: _GuidedEngine, job: Job, tmp_path: Path, cfg: WorkerConfig | None = None) -> Any:
    pool = ThreadPoolExecutor(2)
    cache_ = DiskFeatureCache(tmp_path / "cache", max_bytes=64 * 1024 * 1024)
    stage = MediaStage(PreprocessConfig(), cache_, cpu_pool=pool, io_pool=pool, writer=pool)
    metrics = Metrics()
    runner = JobRunner(cfg or config(), engine=engine, media=stage, metrics=metrics)  # type: ignore[arg-type]
    try:
        outcome = asyncio.run(runner.run(job.model_dump_json().encode(), CTX, 0))
    finally:
        pool.shutdown(wait=True)
    return outcome.record, metrics


def test_a_guided_job_gets_its_answer_parsed(tokenizer: tuple[Any, int], tmp_path: Path) -> None:
    engine = _GuidedEngine(tokenizer, '{"tags":["a tag","another"]}')
    record, metrics = _run(engine, _job(task="tags", metadata={"k": 1}), tmp_path)
    assert isinstance(record, Result), record
    assert record.json_ == {"tags": ["a tag", "another"]} and record.task == "tags"
    assert record.text == '{"tags":["a tag","another"]}' and record.metadata == {"k": 1}
    ((instruction, guide),) = engine.asked
    assert "tags" in instruction and "this image." in instruction
    assert guide is not None and guide.kind == "json" and '"maxItems":10' in guide.spec
    assert metrics.response_formats.labels("compiled")._value.get() == 1


def test_an_uncompilable_format_fails_typed_before_any_fetch(
    tokenizer: tuple[Any, int], tmp_path: Path
) -> None:
    engine = _GuidedEngine(tokenizer, "unused")
    # Fetching this would fail (nothing listens there): the refusal must come first.
    job = Job(
        job_id="bad", media=[{"uri": "http://127.0.0.1:9/x.jpg"}],
        response_format=_schema(UNRESOLVED),
    )  # fmt: skip
    record, metrics = _run(engine, job, tmp_path)
    assert isinstance(record, Failure), record
    assert record.code == ErrorCode.INVALID_RESPONSE_FORMAT and not record.retryable
    assert record.attempts == 1 and "missing" in record.message
    assert engine.asked == [] and metrics.response_formats.labels("refused")._value.get() == 1


@pytest.mark.parametrize(
    ("job", "code"),
    [
        (_job(task="nope"), ErrorCode.UNKNOWN_TASK),
        (_job(task="tags", generation={"ignore_eos": True}), ErrorCode.INVALID_RESPONSE_FORMAT),
    ],
)
def test_task_problems_are_typed_failures(
    tokenizer: tuple[Any, int], tmp_path: Path, job: Job, code: ErrorCode
) -> None:
    engine = _GuidedEngine(tokenizer, "unused")
    record, _ = _run(engine, job, tmp_path)
    assert isinstance(record, Failure) and record.code == code and not record.retryable
    assert engine.asked == []


def test_an_answer_cut_at_max_tokens_is_incomplete_output(
    tokenizer: tuple[Any, int], tmp_path: Path
) -> None:
    engine = _GuidedEngine(tokenizer, '{"tags":["a', finish="length")
    record, _ = _run(engine, _job(task="tags", generation={"max_tokens": 5}), tmp_path)
    assert isinstance(record, Failure) and record.code == ErrorCode.INCOMPLETE_OUTPUT
    assert "max_tokens (5)" in record.message and not record.retryable


def test_an_unguided_job_sends_no_guide(tokenizer: tuple[Any, int], tmp_path: Path) -> None:
    engine = _GuidedEngine(tokenizer, "a caption")
    record, metrics = _run(engine, _job(), tmp_path)
    assert isinstance(record, Result) and record.json_ is None and record.task is None
    assert engine.asked == [(DEFAULT_PROMPTS["image"], None)]
    assert metrics.response_formats.labels("compiled")._value.get() == 0


def test_a_configured_task_that_cannot_run_stops_the_worker_at_start(
    tokenizer: tuple[Any, int],
) -> None:
    from mmworker.errors import ConfigError

    bad = {"prompt": "p", "response_format": {"type": "json_schema", "schema": UNRESOLVED}}
    for tasks, fails in (({"broken": bad}, True), ({"fine": {"prompt": "p"}}, False)):
        cfg = load_config(tasks=tasks)
        runner = JobRunner(cfg, _GuidedEngine(tokenizer, ""), None, Metrics())  # type: ignore[arg-type]
        if fails:
            with pytest.raises(ConfigError, match=r"tasks\.broken\.response_format: .*missing"):
                asyncio.run(runner.check_tasks())
        else:
            asyncio.run(runner.check_tasks())  # shipped tasks are not compiled at start
