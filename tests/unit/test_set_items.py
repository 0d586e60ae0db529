"""`--set KEY=VALUE` is read one way everywhere: by `mmworker` and by the bench scripts that pass
the same items to a worker and to its peers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mmworker import cli
from mmworker.errors import ConfigError
from mmworker.set_items import parse_set, parse_sets

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@pytest.mark.parametrize("item", ["limits.max_in_flight", "=64", " =64", ""])
def test_an_item_without_a_key_and_an_equals_sign_is_refused(item: str) -> None:
    with pytest.raises(ConfigError, match="--set needs KEY=VALUE"):
        parse_set(item)


@pytest.mark.parametrize(
    ("item", "pair"),
    [
        ("engine.max_num_seqs=64", ("engine.max_num_seqs", 64)),
        ('preprocess.allowed_roots=["/data"]', ("preprocess.allowed_roots", ["/data"])),
        ("kafka.input_topic=jobs", ("kafka.input_topic", "jobs")),  # not JSON: the text itself
        ('engine.load_format="dummy"', ("engine.load_format", "dummy")),
        ("engine.mm_processor_cache_gb=null", ("engine.mm_processor_cache_gb", None)),
        ("engine.mm_processor_cache_gb=None", ("engine.mm_processor_cache_gb", None)),
        (" cache.min_image_pixels =0", ("cache.min_image_pixels", 0)),
        ("kafka.sasl_plain_password=a=b", ("kafka.sasl_plain_password", "a=b")),
        ("kafka.client_id=", ("kafka.client_id", "")),
    ],
)
def test_values_are_json_where_they_parse_and_text_otherwise(item: str, pair: object) -> None:
    assert parse_set(item) == pair


def test_a_key_given_twice_keeps_its_last_value_as_the_worker_does() -> None:
    items = ["engine.max_num_seqs=8", "kafka.input_topic=jobs", "engine.max_num_seqs=64"]
    assert parse_sets(items) == {"engine.max_num_seqs": 64, "kafka.input_topic": "jobs"}
    args = cli.build_parser().parse_args(["run", *(a for i in items for a in ("--set", i))])
    assert cli.overrides_from(args)["engine"]["max_num_seqs"] == 64


def test_the_soak_bench_refuses_an_item_without_an_equals_sign(tmp_path: Path) -> None:
    from bench.soak import Options, worker_settings

    assert (
        worker_settings(Options(sets=["engine.max_num_seqs=64"]), tmp_path)["engine.max_num_seqs"]
        == 64
    )
    with pytest.raises(ConfigError, match="needs KEY=VALUE"):
        worker_settings(Options(sets=["engine.max_num_seqs"]), tmp_path)


def test_the_peer_bench_refuses_an_item_without_an_equals_sign(tmp_path: Path) -> None:
    from bench.e2e_config import Options
    from bench.peers.worker import worker_args

    topics = {"input": "in", "output": "out", "dlq": "dlq"}
    with pytest.raises(ConfigError, match="needs KEY=VALUE"):
        worker_args(
            Options(sets=["engine.max_num_seqs"], processes=1),
            "127.0.0.1:9092",
            tmp_path,
            topics,
            "group",
            str(tmp_path / "model"),
            0,
            [tmp_path],
        )


def test_the_segments_bench_reads_items_as_the_worker_does(tmp_path: Path) -> None:
    from bench.segments import engine_dtype, worker_args

    topics = {"input": "in", "output": "out", "dlq": "dlq"}
    with pytest.raises(ConfigError, match="needs KEY=VALUE"):
        worker_args(tmp_path, 0, "127.0.0.1:9092", topics, ["engine.dtype"])
    assert engine_dtype(["engine.dtype=bfloat16"], {}) == ("bfloat16", "engine.dtype")
    assert engine_dtype(['engine.dtype="float32"'], {}) == ("float32", "engine.dtype")
    assert engine_dtype(['engine.dtype="auto"'], {"plain_vllm": {"engine_dtype": "float16"}}) == (
        "float16",
        "the peer's engine",
    )
