"""Guided (structured) output: a job's `response_format` checked here, enforced by the engine.

The grammar backend is **xgrammar**, fixed in the engine's arguments (`ENGINE_STRUCTURED_OUTPUTS`)
rather than vLLM's "auto": a v1 engine builds one backend, for the first guided request it meets,
and "auto" decides per request, so a schema xgrammar rejects would silently be sent to whichever
backend came first. Compact JSON (`disable_any_whitespace`): with whitespace allowed between
tokens, a weak model can spend every token on newlines and never close the answer.

Every distinct constraint is compiled once per worker, here, with xgrammar against the engine's
own tokenizer and vocabulary — the same compile the engine would do — in a thread, under a time
limit, and its verdict is remembered: a backfill that sends one schema a million times compiles
it once here and once in the engine (whose compiler has a cache of its own, keyed by the spec
text, which is why the spec is always sent in one canonical form). What does not compile never
reaches the engine: it becomes `invalid_response_format` instead of an engine error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mmworker_schemas.job import ChoiceFormat, JsonSchemaFormat, ResponseFormat
from pydantic import JsonValue

from mmworker.errors import IncompleteOutput, InvalidResponseFormat

if TYPE_CHECKING:
    from mmworker.config import StructuredOutputConfig

log = logging.getLogger(__name__)

#: vLLM `structured_outputs_config` of every engine (see the module docstring).
ENGINE_STRUCTURED_OUTPUTS: dict[str, Any] = {"backend": "xgrammar", "disable_any_whitespace": True}
_SEPARATORS = (",", ":")

GuideKind = Literal["json", "regex", "choice"]

#: Errors the grammar backend raises for a constraint it cannot compile (xgrammar's C++ errors
#: arrive as RuntimeError or ValueError; vLLM's validation errors are ValueErrors). Anything else
#: is a bug and reaches the job as one.
_COMPILE_ERRORS = (RuntimeError, ValueError)
#: xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: ".
_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+:\d+: ")


@dataclass(frozen=True, slots=True)
class Guide:
    """A constraint in the one textual form sent to the engine (its compile-cache key)."""

    kind: GuideKind
    #: Compact JSON of the schema (key order kept: it is the order of the answer's fields), the
    #: regex itself, or compact JSON of the choice list.
    spec: str

    @classmethod
    def of(cls, fmt: ResponseFormat) -> Guide:
        if isinstance(fmt, JsonSchemaFormat):
            return cls("json", _compact(fmt.schema_))
        if isinstance(fmt, ChoiceFormat):
            return cls("choice", _compact(fmt.choices))
        return cls("regex", fmt.regex)

    def fields(self) -> dict[str, Any]:
        """The keyword of vLLM's StructuredOutputsParams that carries this constraint."""
        if self.kind == "json":
            return {"json": self.spec}
        if self.kind == "choice":
            return {"choice": json.loads(self.spec)}
        return {"regex": self.spec}


def _compact(value: object) -> str:
    return json.dumps(value, separators=_SEPARATORS, ensure_ascii=False)


def sampling_kwargs(guide: Guide | None) -> dict[str, Any]:
    """The SamplingParams keyword for a guide, in the form this vLLM release takes; nothing at
    all for an unguided job, so its request is exactly what it was before guidance existed."""
    if guide is None:
        return {}
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:  # releases from before the rename to structured outputs
        from vllm.sampling_params import GuidedDecodingParams  # type: ignore[attr-defined]

        return {"guided_decoding": GuidedDecodingParams(**guide.fields())}
    return {"structured_outputs": StructuredOutputsParams(**guide.fields())}


def parse_answer(guide: Guide, text: str, finish_reason: str, max_tokens: int) -> JsonValue:
    """The answer of a guided job: parsed when it is JSON, else None (the text is the answer).

    Only a `stop` is a complete answer: the grammar lets the model end only once the answer is
    complete, so a `length` stop is an answer cut short. `strict=False`: xgrammar's JSON strings
    admit raw control characters, which the result then carries escaped.
    """
    if finish_reason != "stop":
        raise IncompleteOutput(
            f"the answer reached max_tokens ({max_tokens}) before it completed its "
            "response_format: raise generation.max_tokens (or the task's max_tokens), or bound "
            "the answer in the schema (maxItems, maxLength, enum, maximum)"
        )
    if guide.kind != "json":
        return None
    try:
        parsed: JsonValue = json.loads(text, strict=False)
    except json.JSONDecodeError as exc:
        raise IncompleteOutput(f"the guided answer is not complete JSON: {exc}") from None
    return parsed


def schema_depth(value: object) -> int:
    """Nesting of objects and lists in a JSON document, iteratively (no recursion limit)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in node)
    return deepest


def choice_grammar(choices: list[str]) -> str:
    """The EBNF vLLM turns a choice list into (`choice_as_grammar`), so the check compiles what
    the engine will."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(map(escape, c)) + '"' for c in choices)


@dataclass(frozen=True, slots=True)
class Checked:
    guide: Guide
    #: "compiled": this check compiled it; "cached": a verdict was already known.
    how: Literal["compiled", "cached"]


class GrammarChecker:
    """Refuses, before the engine, every response_format the engine's grammar backend would
    fail on or that breaks the worker's limits; remembers each verdict.

    `tokenizer()` gives the engine's tokenizer and model vocabulary size; it is first called
    at the first compile, so a worker that never sees a guided job never builds xgrammar's
    tokenizer tables.
    """

    def __init__(
        self, cfg: StructuredOutputConfig, tokenizer: Callable[[], tuple[Any, int]]
    ) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        #: Verdicts by digest of (kind, spec): None compiles, a string says why not.
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        #: Compiles under way, so a burst of jobs with one new schema waits for one compile.
        self._pending: dict[bytes, asyncio.Task[str | None]] = {}
        self._slot = asyncio.Semaphore(1)
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()

    async def check(self, fmt: ResponseFormat) -> Checked:
        """Raises InvalidResponseFormat with the reason; otherwise the guide to send."""
        guide = Guide.of(fmt)
        cfg = self._cfg
        size = len(guide.spec.encode())
        if size > cfg.max_schema_bytes:
            raise InvalidResponseFormat(
                f"response_format is {size} bytes as compact JSON; the limit is "
                f"{cfg.max_schema_bytes} (structured_output.max_schema_bytes)"
            )
        if isinstance(fmt, JsonSchemaFormat):
            depth = schema_depth(fmt.schema_)
            if depth > cfg.max_schema_depth:
                raise InvalidResponseFormat(
                    f"the JSON Schema nests {depth} levels of objects and lists; the limit is "
                    f"{cfg.max_schema_depth} (structured_output.max_schema_depth)"
                )
        key = hashlib.sha256(f"{guide.kind}\0{guide.spec}".encode()).digest()
        how: Literal["compiled", "cached"] = "cached"
        if key in self._verdicts:
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        else:
            pending = self._pending.get(key)
            if pending is None:
                how = "compiled"
                pending = asyncio.get_running_loop().create_task(self._compile(key, guide))
                self._pending[key] = pending
                pending.add_done_callback(lambda task: self._settled(key, task))
            # Shielded: the compile belongs to every job waiting for it, not to the first one,
            # whose cancellation (a rebalance) must not fail the others.
            verdict = await asyncio.shield(pending)
        if verdict is not None:
            raise InvalidResponseFormat(f"response_format does not compile: {verdict}")
        return Checked(guide, how)

    def _settled(self, key: bytes, task: asyncio.Task[str | None]) -> None:
        self._pending.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: every waiter may have been cancelled

    async def _compile(self, key: bytes, guide: Guide) -> str | None:
        async with self._slot:
            t0 = time.perf_counter()
            verdict = await self._compile_within_limit(guide)
        log.info(
            "response_format (%s, %d bytes) %s in %.3fs; verdict kept", guide.kind,
            len(guide.spec.encode()), "compiled" if verdict is None else "refused",
            time.perf_counter() - t0,
        )  # fmt: skip
        self._remember(key, verdict)
        return verdict

    async def _compile_within_limit(self, guide: Guide) -> str | None:
        """Compile in a daemon thread: an xgrammar compile cannot be interrupted, and one that
        runs away must neither hold the event loop nor keep the process from exiting."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str | None] = loop.create_future()

        def settle(verdict: str | None, error: BaseException | None) -> None:
            if done.done():  # timed out and abandoned
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(verdict)

        def work() -> None:
            verdict: str | None = None
            error: BaseException | None = None
            try:
                verdict = self._verdict(guide)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting job, not lost
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits now
                loop.call_soon_threadsafe(settle, verdict, error)

        if self._compiler is None:
            # The tokenizer's tables, once per process (seconds for a 150k vocabulary): outside
            # the limit, which is the schema's. Counted in it, a first compile on a loaded host
            # could time out and the schema be refused for good.
            await loop.run_in_executor(None, self._grammar_compiler)
        threading.Thread(target=work, name="grammar-compile", daemon=True).start()
        limit = self._cfg.compile_timeout_s
        try:
            async with asyncio.timeout(limit):  # not wait_for: see `mmworker.gate.shared`
                return await asyncio.shield(done)
        except TimeoutError:
            # It may still finish, or fail, after nobody waits for it.
            done.add_done_callback(lambda f: f.cancelled() or f.exception())
            return (
                f"compiling it took longer than {limit}s (structured_output.compile_timeout_s); "
                "simplify the schema or regex"
            )

    def _verdict(self, guide: Guide) -> str | None:
        """None when the engine can run this constraint, else why not (in the thread)."""
        refused = _vllm_refusal(guide)
        if refused is not None:
            return _LOG_PREFIX.sub("", refused)
        try:
            compiler = self._grammar_compiler()
            if guide.kind == "json":
                compiler.compile_json_schema(
                    guide.spec, any_whitespace=False, separators=_SEPARATORS
                )
            elif guide.kind == "regex":
                compiler.compile_regex(guide.spec)
            else:
                compiler.compile_grammar(choice_grammar(json.loads(guide.spec)))
        except _COMPILE_ERRORS as exc:
            return _LOG_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
        return None

    def _grammar_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                tokenizer, vocab_size = self._tokenizer()
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
                # No compiled-grammar cache here: only the verdict is kept, not the tables.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _remember(self, key: bytes, verdict: str | None) -> None:
        self._verdicts[key] = verdict
        while len(self._verdicts) > self._cfg.cache_entries:
            self._verdicts.popitem(last=False)


def _vllm_refusal(guide: Guide) -> str | None:
    """Why vLLM's own request check for the xgrammar backend refuses this constraint (it also
    refuses schema keywords xgrammar would silently ignore), where this release has that check;
    None when it passes."""
    try:
        from vllm import SamplingParams
        from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    except ImportError:
        return None
    try:
        from vllm.exceptions import VLLMValidationError

        refusals: tuple[type[Exception], ...] = (ValueError, VLLMValidationError)
    except ImportError:  # releases whose validation errors are plain ValueErrors
        refusals = (ValueError,)
    try:
        validate_xgrammar_grammar(SamplingParams(**sampling_kwargs(guide)))
    except refusals as exc:
        return str(exc).strip() or type(exc).__name__
    return None
