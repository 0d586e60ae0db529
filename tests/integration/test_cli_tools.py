"""`mmworker submit` and `mmworker tail` as a user runs them, against the real broker."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mmworker_schemas import Job

from mmworker.config import KafkaConfig
from mmworker.devkit.broker import EmbeddedBroker
from mmworker.devkit.samples import sample_image, sample_video
from mmworker.kafka_io import ensure_topics

pytestmark = pytest.mark.integration


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mmworker", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_submit_a_directory_then_tail_it_back(broker: EmbeddedBroker, tmp_path: Path) -> None:
    topic = f"cli-{uuid.uuid4().hex[:6]}"
    ensure_topics(KafkaConfig(bootstrap_servers=broker.bootstrap), {topic: 2})
    media = tmp_path / "media"
    (media / "nested").mkdir(parents=True)
    (media / "a.jpg").write_bytes(sample_image(seed=1))
    (media / "nested" / "b.png").write_bytes(sample_image(seed=2, fmt="PNG"))
    (media / "clip.mp4").write_bytes(sample_video(seconds=1))
    (media / "notes.txt").write_text("not media: skipped by content")
    (media / "photo.bin").write_bytes(sample_image(seed=3, width=64, height=48))  # no suffix

    roots = json.dumps([str(media)])
    sent = _cli("submit", str(media), "--bootstrap-servers", broker.bootstrap, "--topic", topic,
                "--prompt", "What is this?", "--inline-max-bytes", "20000",
                "--set", f"preprocess.allowed_roots={roots}")  # fmt: skip
    assert sent.returncode == 0, sent.stderr
    assert f"skipped {media / 'notes.txt'}: media is text" in sent.stderr
    lines = [ln.split("\t") for ln in sent.stdout.splitlines()]
    assert sorted(Path(src).name for _, src in lines) == ["a.jpg", "b.png", "clip.mp4", "photo.bin"]

    read = _cli("tail", "--bootstrap-servers", broker.bootstrap, "--topics", topic, "--json",
                "--timeout", "10")  # fmt: skip  # idle seconds, counted from before it connects
    assert read.returncode == 0, read.stderr
    jobs = [Job.model_validate(json.loads(ln)) for ln in read.stdout.splitlines()]
    assert {j.job_id for j in jobs} == {job_id for job_id, _ in lines}
    assert all(j.prompt == "What is this?" for j in jobs)
    assert {str(j.metadata["source"]) for j in jobs} == {src for _, src in lines}
    by_name = {Path(src).name: job_id for job_id, src in lines}
    refs = {j.job_id: j.media[0] for j in jobs}
    # The small clip goes inline; the larger images exceed --inline-max-bytes: file:// URIs.
    assert refs[by_name["clip.mp4"]].data == (media / "clip.mp4").read_bytes()
    assert refs[by_name["a.jpg"]].uri == (media / "a.jpg").resolve().as_uri()


def test_submit_reports_missing_files(broker: EmbeddedBroker, tmp_path: Path) -> None:
    out = _cli("submit", str(tmp_path / "nope.jpg"), "--bootstrap-servers", broker.bootstrap)
    assert out.returncode == 1
    warning, *rest = out.stderr.splitlines(keepends=True)
    assert warning.startswith("warning: no worker is consuming group")  # none runs in this group
    assert "".join(rest) == (
        f"skipped {tmp_path / 'nope.jpg'}: no such file\nmmworker submit: nothing to submit\n"
    )
