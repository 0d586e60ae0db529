"""bench/compare.py's merge: which row is the base, the ratios, the spreads, what is missing.

The fake stage reports carry the keys a real bench/e2e.py report has (taken from a CPU run of
bench/compare.py with the tiny model), so a renamed key in e2e breaks these tests, not a GPU run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import compare  # noqa: E402
from bench.e2e_report import table_rows  # noqa: E402

OPTIONS = {
    "model": "tiny",
    "images": 40,
    "videos": 2,
    "max_tokens": 8,
    "load_format": "auto",
    "out": "bench/out/compare-cpu-peers1.json",
    "passes": [],
    "skip_naive": False,
    "skip_raw": False,
    "only_raw_engines": False,
    "raw_repeats": 1,
    "naive_images": 10,
    "naive_videos": 1,
    "image_size": 448,
    "video_seconds": 8.0,
    "video_fps": 24,
    "video_size": 448,
    "ignore_eos": True,
    "processes": None,
    "raw_engines": None,
    "preprocess_workers": 1,
    "max_model_len": 4096,
    "sets": [],
    "profile": False,
    "profile_measured": False,
    "keep": False,
    "work_dir": "bench/out/compare-cpu-work",
    "peers_from": None,
    "serve_from": None,
    "timeout_s": 1800.0,
}

#: A Qwen2.5-VL-shaped config with the keys bench/mfu.py reads (the tiny model's sizes).
CONFIG = {
    "text_config": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    },
    "vision_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "depth": 2,
        "spatial_merge_size": 2,
        "in_channels": 3,
        "temporal_patch_size": 2,
        "patch_size": 14,
        "fullatt_block_indexes": [1],
        "window_size": 112,
        "out_hidden_size": 128,
    },
}


def row(peer: str, kind: str, jobs_per_s: float, jobs: int = 40) -> dict[str, Any]:
    return {
        "peer": peer,
        "kind": kind,
        "jobs": jobs,
        "failures": 0,
        "wall_s": jobs / jobs_per_s,
        "jobs_per_s": jobs_per_s,
        "output_tokens": 8 * jobs,
        "output_tokens_per_s": 8 * jobs_per_s,
        "latency_p50_s": 0.5,
        "latency_p95_s": 0.9,
        "engine_busy_s": None,
        "engine_busy_fraction": 1.0,
        "output_tokens_min_max": [8, 8],
        "prompt_tokens_mean": 330.0 if kind == "image" else 2100.0,
        "loadavg_1m_at_end": 2.0,
    }


def peers_report(raw: dict[str, float], engines: dict[str, float] | None = None) -> dict[str, Any]:
    """A peers stage: raw (and raw hot, naive; raw ×2 engines when given) per kind, no passes."""
    peers: dict[str, Any] = {
        "engine_kwargs": {},
        "scheduler": {},
        "startup_s": 21.5,
        "preprocess": {},
        "raw": {
            k: {
                "raw": {**row("raw", k, v), "runs_jobs_per_s": [v]},
                "raw hot": {**row("raw hot", k, 2 * v), "runs_jobs_per_s": [2 * v]},
            }
            for k, v in raw.items()
        },
        "naive": {k: row("naive", k, v / 10, jobs=10) for k, v in raw.items()},
        "log": "peers.log",
    }
    if engines:
        peers["raw_engines"] = {
            "engines": 2,
            "all_ready_s": 60.0,
            "per_engine": [{"startup_s": 25.0}, {"startup_s": 30.0}],
            **{k: row("raw ×2 engines", k, v) for k, v in engines.items()},
        }
    report = {"options": OPTIONS, "peers": peers, "worker": {}, "ok": True, "errors": []}
    report["rows"] = table_rows(report)
    return report


def worker_report(
    pass_name: str, rates: dict[str, float], peers: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A worker stage; with `peers`, their rows copied in as `--peers-from` does."""
    doc: dict[str, Any] = {
        "topics": {},
        "log": f"worker-{pass_name}.log",
        "processes": 1,
        "startup_s": 30.2,
        "exit_code": 0,
        "log_tail": "",
        "shutdown_line": "",
    }
    for k, v in rates.items():
        doc[k] = {
            **row(f"worker {pass_name}", k, v),
            "jobs_per_s_from_ready": v * 0.8,
            "jobs_per_s_first_to_last_result": v * 1.1,
            "visual_tokens_mean": 256.0 if k == "image" else 2048.0,
            "cache_hit_fraction": 1.0 if pass_name == "warm" else 0.0,
            "mean_s": {"queue_wait_s": 1.0, "engine_s": 0.5, "total_s": 1.6},
            "metrics_mean_stage_s": {"fetch": None, "preprocess": 0.1, "engine": 0.5},
            "failure_codes": [],
        }
    report = {
        "options": OPTIONS,
        "peers": dict((peers or {}).get("peers") or {}),
        "worker": {pass_name: doc},
        "ok": True,
        "errors": [],
    }
    report["rows"] = table_rows(report)
    return report


def ok(report: dict[str, Any] | None) -> dict[str, Any]:
    return {"report": report, "ok": bool(report and report.get("ok")), "error": None}


def full_run() -> dict[str, dict[str, Any]]:
    p1 = peers_report({"image": 10.0, "video": 2.0}, engines={"image": 12.0, "video": 1.5})
    p2 = peers_report({"image": 11.0, "video": 2.5}, engines={"image": 9.0, "video": 1.0})
    return {
        "peers1": ok(p1),
        "cold1": ok(worker_report("cold", {"image": 15.0, "video": 3.0}, p1)),
        "cold2": ok(worker_report("cold", {"image": 18.0, "video": 2.5}, p1)),
        "warm": ok(worker_report("warm", {"image": 24.0, "video": 5.0}, p1)),
        "peers2": ok(p2),
    }


def test_best_peer_is_the_faster_of_the_two_runs_best_rows_per_kind() -> None:
    c = compare.combine(full_run())
    image, video = c["kinds"]["image"], c["kinds"]["video"]
    # images: run 1's raw ×2 (12) beats run 2's raw (11); videos: run 2's raw (2.5) wins.
    assert image["best_peer"] == {"run": "peers1", "peer": "raw ×2 engines", "jobs_per_s": 12.0}
    assert video["best_peer"] == {"run": "peers2", "peer": "raw", "jobs_per_s": 2.5}
    assert [w["label"] for w in image["worker_rows"]] == [
        "worker cold 1",
        "worker cold 2",
        "worker warm",
    ]
    assert [w["ratio_vs_best"] for w in image["worker_rows"]] == [1.25, 1.5, 2.0]
    # against run 2's peers, not run 1's (which the worker JSONs themselves divide by)
    assert [w["ratio_vs_best"] for w in video["worker_rows"]] == [1.2, 1.0, 2.0]
    assert c["ok"] is True and c["missing"] == [] and c["errors"] == []


def test_every_peer_row_of_both_runs_and_no_copied_peer_row_from_a_worker_stage() -> None:
    c = compare.combine(full_run())
    image = c["kinds"]["image"]
    seen = [(r["run"], r["peer"]) for r in image["peer_rows"]]
    for run in ("peers1", "peers2"):
        for peer in ("raw", "raw hot", "raw ×2 engines", "naive"):
            assert (run, peer) in seen
    assert len(seen) == 8  # the worker stages' --peers-from copies are not counted again
    assert {r["run"] for r in image["worker_rows"]} == {"cold1", "cold2", "warm"}


def test_spreads_of_the_peer_runs_and_of_the_cold_runs() -> None:
    spread = compare.combine(full_run())["kinds"]["image"]["spread"]
    assert spread["peers_best"] == {"n": 2, "min": 11.0, "max": 12.0, "spread_pct": 9.09}
    assert spread["worker_cold"] == {"n": 2, "min": 15.0, "max": 18.0, "spread_pct": 20.0}
    assert spread["peers_by_row"]["raw ×2 engines"]["spread_pct"] == pytest.approx(33.33)
    assert compare.spread([]) is None
    zero = compare.spread([0.0, 1.0])
    assert zero is not None and zero["spread_pct"] is None  # no ratio to a zero rate


def test_start_up_of_every_run() -> None:
    s = compare.combine(full_run())["startup_s"]
    assert s["peers1"] == {
        "raw_engine_s": 21.5,
        "raw_engines_all_ready_s": 60.0,
        "raw_engines_each_s": [25.0, 30.0],
    }
    assert s["cold2"] == {"worker_ready_s": 30.2, "processes": 1}


def test_a_failed_stage_is_recorded_and_its_rows_are_missing() -> None:
    stages = full_run()
    broken = worker_report("cold", {"image": 16.0})  # its video pass died
    broken["ok"], broken["errors"] = False, ["worker cold: the worker exited"]
    stages["cold2"] = ok(broken)
    stages["peers2"] = {"report": None, "ok": False, "error": "bench/e2e.py exited -9"}
    c = compare.combine(stages)
    assert c["ok"] is False
    assert c["missing"] == [
        "image peers2 best peer",
        "video peers2 best peer",
        "video worker cold 2",
    ]
    assert c["errors"] == [
        "cold2: worker cold: the worker exited",
        "peers2: bench/e2e.py exited -9",
    ]
    # the base falls back to the run that finished
    assert c["kinds"]["video"]["best_peer"]["run"] == "peers1"
    assert c["kinds"]["image"]["spread"]["worker_cold"]["max"] == 16.0


def test_a_run_cut_short_is_not_ok_even_when_its_stages_were() -> None:
    stages = full_run()
    del stages["warm"], stages["peers2"]
    c = compare.combine(stages)
    assert c["ok"] is False
    assert "image worker warm" in c["missing"]


def test_mfu_per_row_with_a_config_and_none_for_cached_rows() -> None:
    c = compare.combine(full_run(), config=CONFIG, peak_tflops=1.0)
    image = c["kinds"]["image"]
    by = {(r["run"], r["peer"]): r for r in image["peer_rows"]}
    raw = by[("peers1", "raw")]
    assert raw["mfu"] == pytest.approx(raw["flops_per_job"] * 10.0 / 1e12)
    assert by[("peers1", "raw hot")]["mfu"] is None
    warm = image["worker_rows"][2]
    assert warm["label"] == "worker warm" and warm["mfu"] is None
    assert image["worker_rows"][0]["mfu"] > 0
    assert "mfu" not in compare.combine(full_run())["kinds"]["image"]["peer_rows"][0]


def test_stage_flags_come_after_the_users_and_worker_stages_skip_the_peers() -> None:
    user = ["--model", "tiny", "--set", "limits.max_in_flight=64", "--processes", "2"]
    peers = compare.stage_argv("peers2", user, Path("o.json"), Path("w"), None)
    assert peers == [*user, "--passes", "", "--work-dir", "w", "--out", "o.json"]
    warm = compare.stage_argv("warm", user, Path("o.json"), Path("w"), Path("p1.json"))
    assert warm[: len(user)] == user
    tail = warm[len(user) :]
    assert tail == [
        *["--work-dir", "w", "--out", "o.json", "--skip-raw", "--skip-naive"],
        *["--passes", "warm", "--peers-from", "p1.json"],
    ]


def test_a_stage_whose_process_fails_is_recorded_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real child that dies without a report, and one that writes a not-ok report."""
    out = tmp_path / "stage.json"
    out.write_text(json.dumps({"ok": True}))  # an older run's: must not stand in
    dies = tmp_path / "dies.py"
    dies.write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(compare, "E2E", dies)
    rec = compare.run_stage("cold1", [], out)
    assert rec["rc"] == 3 and rec["report"] is None and rec["ok"] is False
    assert rec["error"] == "bench/e2e.py exited 3"
    half = tmp_path / "half.py"
    half.write_text(
        "import json, sys\n"
        "json.dump({'ok': False, 'errors': ['peers: out of memory']}, open(sys.argv[-1], 'w'))\n"
        "raise SystemExit(1)\n"
    )
    monkeypatch.setattr(compare, "E2E", half)
    rec = compare.run_stage("peers1", ["--out", str(out)], out)
    assert rec["ok"] is False and rec["report"]["errors"] == ["peers: out of memory"]


def test_flags_compare_sets_itself_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before any stage runs (`--out` is e2e's, not an abbreviation of `--out-dir`)."""
    never = tmp_path / "never.py"
    never.write_text("raise SystemExit('a stage ran')\n")
    monkeypatch.setattr(compare, "E2E", never)
    for flags in (["--passes", "cold"], ["--out", "x.json"], ["--peers-from", "p.json"]):
        with pytest.raises(SystemExit, match="sets"):
            compare.main([*flags, "--out-dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == [never]


def test_main_runs_five_stages_rewrites_the_report_and_resume_skips_finished_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in e2e (a real child process) writes real-shaped reports; the warm stage fails."""
    p1 = peers_report({"image": 10.0, "video": 2.0})
    fakes = {
        "peers1": p1,
        "cold1": worker_report("cold", {"image": 15.0, "video": 3.0}, p1),
        "cold2": worker_report("cold", {"image": 18.0, "video": 2.5}, p1),
        "peers2": peers_report({"image": 11.0, "video": 2.5}),
    }
    for stage, report in fakes.items():
        (tmp_path / f"fake-{stage}.json").write_text(json.dumps(report))
    e2e = tmp_path / "e2e.py"
    e2e.write_text(
        "import shutil, sys, time\n"
        "time.sleep(0.15)  # a wall that rounds to more than 0 s\n"
        "out = sys.argv[sys.argv.index('--out') + 1]\n"
        "stage = out.rsplit('-', 1)[1][: -len('.json')]\n"
        "if stage == 'warm':\n"
        "    raise SystemExit(1)\n"
        f"shutil.copy({str(tmp_path)!r} + f'/fake-{{stage}}.json', out)\n"
    )
    monkeypatch.setattr(compare, "E2E", e2e)
    args = ["--out-dir", str(tmp_path), "--name", "t", "--images", "40", "--videos", "2"]
    assert compare.main(args) == 1
    c = json.loads((tmp_path / "t.json").read_text())
    assert list(c["stages"]) == ["peers1", "cold1", "cold2", "warm", "peers2"]
    assert c["missing"] == ["image worker warm", "video worker warm"]
    assert c["stages"]["warm"]["error"] == "bench/e2e.py exited 1"
    assert c["stages"]["cold1"]["argv"][-2:] == ["--peers-from", str(tmp_path / "t-peers1.json")]
    assert c["kinds"]["image"]["best_peer"] == {"run": "peers2", "peer": "raw", "jobs_per_s": 11.0}
    walls = {s: r["wall_s"] for s, r in c["stages"].items()}
    assert all(w > 0 for w in walls.values())
    # resumed: the four finished stages are reused, only warm runs again (and now succeeds)
    fakes["warm"] = worker_report("warm", {"image": 24.0, "video": 5.0}, p1)
    (tmp_path / "fake-warm.json").write_text(json.dumps(fakes["warm"]))
    e2e.write_text(e2e.read_text().replace("'warm'", "'never'"))
    (tmp_path / "fake-peers1.json").unlink()  # a rerun of peers1 would fail now
    assert compare.main([*args, "--resume"]) == 0
    c = json.loads((tmp_path / "t.json").read_text())
    assert [s for s, r in c["stages"].items() if r.get("reused")] == [
        "peers1",
        "cold1",
        "cold2",
        "peers2",
    ]
    # each reused stage keeps the wall its own run took, not 0
    assert {s: c["stages"][s]["wall_s"] for s in ("peers1", "cold1", "cold2", "peers2")} == {
        s: walls[s] for s in ("peers1", "cold1", "cold2", "peers2")
    }
    assert c["kinds"]["video"]["worker_rows"][2]["ratio_vs_best"] == 2.0


def test_resume_runs_again_a_stage_whose_report_was_cut_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/e2e.py writes its report after every stage, so a call killed by the device's time
    limit leaves one with `ok` still true; `partial` marks it, and --resume must not reuse it."""
    p1 = peers_report({"image": 10.0, "video": 2.0})
    (tmp_path / "t-peers1.json").write_text(json.dumps({**p1, "partial": True}))
    (tmp_path / "fake.json").write_text(json.dumps(p1))
    e2e = tmp_path / "e2e.py"
    e2e.write_text(  # every stage writes a whole report, then fails: a rerun shows as its error
        "import shutil, sys\n"
        f"shutil.copy({str(tmp_path / 'fake.json')!r}, sys.argv[sys.argv.index('--out') + 1])\n"
        "raise SystemExit(1)\n"
    )
    monkeypatch.setattr(compare, "E2E", e2e)
    args = ["--out-dir", str(tmp_path), "--name", "t", "--images", "40", "--videos", "2"]
    assert compare.main([*args, "--resume"]) == 1
    c = json.loads((tmp_path / "t.json").read_text())
    assert not c["stages"]["peers1"].get("reused")
    assert c["stages"]["peers1"]["error"] == "bench/e2e.py exited 1"
    assert compare.finished({"ok": True, "partial": True}) is False
    assert compare.finished({"ok": True, "partial": False}) is True
