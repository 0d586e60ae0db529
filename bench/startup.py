"""How long `mmworker run` takes to be ready, against a plain vLLM engine of the same model, with
the compile caches cold and warm: the start-up question of a fleet that scales out on lag or
restarts a worker.

Every row is timed from the moment this script starts the process, so imports count on both
sides:

- plain: a new Python process that does what a user of vLLM alone does (`from vllm import LLM`,
  `LLM(...)` with the arguments the worker gives its engine, then `generate` on one image):
  "ready" once `LLM(...)` returned, "first result" once the image's caption came back;
- worker: `mmworker run` (one process; the host's default; the default with its engines loaded
  one after another, `engine.start_together = false`) with one image job posted before it
  starts: "ready" at its "consuming" log line (as bench/e2e.py counts it), "first result" when
  the caption was on the output topic; each process's own start-up line (where its seconds
  went, logged once it holds partitions) is kept in the row.

Cache states: "cold" gives the start new, empty vLLM/torch.compile/Triton/Inductor cache
directories (and the worker a new feature cache directory); "warm" reuses those of the kind's
cold start, which filled them. Each kind keeps its own, so one does not warm the other. Caches
no row controls (the OS page cache over vLLM, torch and the model files; CUDA's JIT cache) are
filled before the rows (`--prime files`, the default: the libraries and the model read, one CUDA
matmul; `--prime start`: one unrecorded plain start), so the row that happens to run first does
not pay for the others.

    .venv/bin/python bench/startup.py                                  # CPU, the tiny model
    python3 bench/startup.py --model DIR --load-format dummy --out bench/out/startup.json  # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    COMPILE_CACHE_VARS,
    OUT,
    add_set_option,
    commit,
    environment,
    make_images,
)
from bench.e2e_config import Options, child_env, resolve_model_path  # noqa: E402
from bench.e2e_jobs import image_job, make_topics, post  # noqa: E402

#: kind -> (worker processes, None: the worker's own choice; settings of its own); "plain" is
#: vLLM alone. "worker" (the defaults): several processes' engines load one after another at the
#: cold start, which keeps their KV sizes, and together at the warm start, given those sizes;
#: "worker-in-turn" keeps loading them one after another (`engine.start_together = false`, the
#: default until session 26).
KINDS: dict[str, tuple[int | None, tuple[str, ...]]] = {
    "plain": (None, ()),
    "worker-1": (1, ()),
    "worker": (None, ()),
    "worker-in-turn": (None, ("engine.start_together=false",)),
}
SUMMARY = re.compile(r"start-up: ready ([\d.]+)s after the process started: (.*)")

PLAIN = """
import json, sys, time
from vllm import LLM, SamplingParams
import numpy as np
from PIL import Image
sys.path.insert(0, sys.argv[1])
from bench.peers import raw
cfg = raw.load_worker_config(json.loads(sys.argv[2]))
llm = LLM(**raw.engine_kwargs(cfg, sys.argv[3]))
ready = time.time()
from mmworker.engine import chat_prompt
from mmworker_schemas import DEFAULT_PROMPTS
image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (448, 448, 3), dtype=np.uint8))
prompt = {"prompt": chat_prompt(llm.get_tokenizer(), DEFAULT_PROMPTS["image"], ("image",)),
          "multi_modal_data": {"image": image}}
out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                   use_tqdm=False)
assert out[0].outputs[0].token_ids, out
print("PLAIN " + json.dumps({"ready": ready, "first_result": time.time()}), flush=True)
raw.shutdown(llm)
"""


def cache_env(directory: Path, cold: bool) -> dict[str, str]:
    """Cache directories for one start under `directory`; cold: all of it emptied first (the
    worker's feature cache and KV sizes live there too)."""
    if cold and directory.exists():
        shutil.rmtree(directory)
    env = {}
    for var in COMPILE_CACHE_VARS:
        path = directory / "compile" / var.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    return env


def plain_start(opts: Options, bootstrap: str, directory: Path, model: str, env: dict[str, str],
                log: Path) -> dict[str, Any]:  # fmt: skip
    """A plain `LLM(...)` given the engine arguments the worker's configuration makes (the
    worker arguments are parsed, never run: no topic is read)."""
    from bench.peers.worker import worker_args

    unused = {"input": "unused", "output": "unused", "dlq": "unused"}
    args = worker_args(opts, bootstrap, directory, unused, "probe", model, 0, [directory])
    t0 = time.time()
    with log.open("wb") as f:
        done = subprocess.run(
            [sys.executable, "-c", PLAIN, str(ROOT), json.dumps(args), model],
            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=opts.timeout_s,
            check=False,
        )  # fmt: skip
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("PLAIN ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"plain engine failed ({done.returncode}):\n{text[-3000:]}")
    stamps = json.loads(lines[-1][len("PLAIN ") :])
    return {
        "ready_s": round(stamps["ready"] - t0, 2),
        "first_result_s": round(stamps["first_result"] - t0, 2),
    }


def worker_start(opts: Options, bootstrap: str, work: Path, model: str, env: dict[str, str],
                 log: Path) -> dict[str, Any]:  # fmt: skip
    from bench.common import ResultReader
    from bench.peers.worker import WorkerRun, processes_for, worker_args

    image = make_images(1, 448, seed0=int(time.time()) % 100_000)[0]
    topics = make_topics(bootstrap, "startup")
    job = f"startup-{uuid.uuid4().hex[:8]}"
    post(bootstrap, topics["input"], [(job, image_job(job, image, 16, True))])
    reader = ResultReader(bootstrap, [topics["output"], topics["dlq"]])
    args = worker_args(opts, bootstrap, work, topics, f"startup-{job}", model, 0,
                       [image.parent.resolve(), work])  # fmt: skip
    worker = WorkerRun(args, log, env)
    try:
        ready = worker.wait_ready(opts.timeout_s)
        reader.wait_for({job}, opts.timeout_s, alive=worker.alive)
        seen = reader.seen[job]
        if seen.topic != topics["output"]:
            raise RuntimeError(f"the job went to {seen.topic}: {seen.doc}")
        summary = SUMMARY.findall(worker.log())
    finally:
        code = worker.stop()
        reader.close()
    return {
        "processes": processes_for(opts),
        "ready_s": round(ready - worker.started, 2),
        "first_result_s": round(seen.received - worker.started, 2),
        # per worker process, from that process's own start (the kernel's record of it)
        "startup_summaries": [{"ready_s": float(s), "phases": p} for s, p in summary],
        "exit_code": code,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (built if missing) or a model dir")
    p.add_argument("--load-format", default="auto", help="e.g. dummy (random weights)")
    p.add_argument("--max-model-len", type=int, default=Options.max_model_len)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    p.add_argument("--states", default="cold,warm", help="comma list of cold,warm")
    p.add_argument("--work-dir", type=Path, default=OUT / "startup",
                   help="caches per kind, kept for a warm start in a later call")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument(
        "--prime", choices=("files", "start", "none"), default="files",
        help="before the rows, so the OS page cache and CUDA's own JIT cache do not favour the "
        "rows after the first: 'files' reads the libraries of torch, vLLM, CUDA, Triton and "
        "transformers and the model's files, and runs one CUDA matmul (~35 s on an H100 host); "
        "'start' makes one unrecorded plain start (own throwaway caches, ~2 min)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=OUT / "startup.json")
    add_set_option(p, "extra worker setting (the plain engine follows it too)")
    ns = p.parse_args(argv)
    kinds = [k for k in ns.kinds.split(",") if k]
    states = [s for s in ns.states.split(",") if s]
    if unknown := [k for k in kinds if k not in KINDS] + [
        s for s in states if s not in ("cold", "warm")
    ]:
        p.error(f"unknown kinds/states {unknown}")
    from mmworker.devkit.broker import EmbeddedBroker

    model = resolve_model_path(ns.model)
    work_root = ns.work_dir.resolve()
    report: dict[str, Any] = {"environment": environment(), "model": model, "rows": []}
    if ns.out.exists():  # rows of an earlier call (another --kinds) stay
        report["rows"] = json.loads(ns.out.read_text()).get("rows", [])
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    with EmbeddedBroker() as broker:
        if ns.prime == "files":
            prime_files(model)
        elif ns.prime == "start":
            prime(ns, broker.bootstrap, model, work_root / "prime")
        for kind in kinds:
            processes, own = KINDS[kind]
            opts = Options(model=ns.model, load_format=ns.load_format,
                           max_model_len=ns.max_model_len, processes=processes,
                           sets=[*ns.sets, *own], timeout_s=ns.timeout_s)  # fmt: skip
            for state in states:
                directory = work_root / kind
                if state == "warm" and not (directory / "compile").is_dir():
                    raise SystemExit(f"a warm {kind} start needs its cold start first (this call "
                                     f"or an earlier one with the same --work-dir)")  # fmt: skip
                env = child_env(opts) | cache_env(directory, state == "cold")
                log = directory / f"{state}.log"  # after cache_env: a cold start empties it
                print(f"[{kind} {state}] starting", flush=True)
                if kind == "plain":
                    row = plain_start(opts, broker.bootstrap, directory, model, env, log)
                else:
                    row = worker_start(opts, broker.bootstrap, directory, model, env, log)
                row = {"kind": kind, "cache": state, "sets": opts.sets, "commit": commit(),
                       **row, "log": str(log)}  # fmt: skip
                print(json.dumps(row), flush=True)
                report["rows"].append(row)
                ns.out.write_text(json.dumps(report, indent=1))
    print_rows(report["rows"])
    return 0


PRIME_FILES = """
import importlib.util, os, sys, time
t0 = time.time()
read = 0
tops = []
for name in ("torch", "vllm", "nvidia", "triton", "flashinfer", "transformers"):
    spec = importlib.util.find_spec(name)
    for top in (spec.submodule_search_locations or []) if spec else []:
        for d, _, files in os.walk(top):
            for f in files:
                if f.endswith((".so", ".py", ".cubin")) or ".so." in f:
                    tops.append(os.path.join(d, f))
for path in tops + [os.path.join(d, f) for d, _, fs in os.walk(sys.argv[1]) for f in fs]:
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 24):
                read += len(chunk)
    except OSError:  # a dangling link, an unreadable file: not worth failing the bench over
        continue
import torch, vllm  # noqa: F401
if torch.cuda.is_available():
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize(); (a @ a).sum().item()
print(f"[prime] read {read / 2**30:.1f} GiB, imported vLLM in {time.time() - t0:.1f}s")
"""


def prime_files(model: str) -> None:
    """`--prime files`: what a first start on a fresh machine pays beyond its own caches (the
    libraries and the model's files read from disk, the GPU's first context), paid by no row."""
    subprocess.run([sys.executable, "-c", PRIME_FILES, model], check=True, cwd=ROOT)


def prime(ns: argparse.Namespace, bootstrap: str, model: str, directory: Path) -> None:
    """The unrecorded start of `--prime start`: the first start on a fresh machine also reads vLLM,
    torch and the model from disk and fills caches no row controls; let it be none of the rows."""
    opts = Options(model=ns.model, load_format=ns.load_format, max_model_len=ns.max_model_len,
                   sets=list(ns.sets), timeout_s=ns.timeout_s)  # fmt: skip
    env = child_env(opts) | cache_env(directory, cold=True)
    print("[prime] an unrecorded plain start", flush=True)
    took = plain_start(opts, bootstrap, directory, model, env, directory / "prime.log")
    print(f"[prime] ready after {took['ready_s']}s", flush=True)


def print_rows(rows: list[dict[str, Any]]) -> None:
    """Each worker row against the plain row of the same cache state that ran last before it
    (else the first after it): calls that add rows to one report pair with their own base."""
    for i, r in enumerate(rows):
        same = [j for j, q in enumerate(rows) if q["kind"] == "plain" and q["cache"] == r["cache"]]
        before = [j for j in same if j < i]
        base = rows[before[-1]] if before else rows[same[0]] if same else None
        worker = base is not None and r["kind"] != "plain"
        ratio = f"{r['ready_s'] / base['ready_s']:.2f}x plain" if worker else ""
        print(f"{r['kind']:>15} {r['cache']:>4}: ready {r['ready_s']:7.1f}s  first result "
              f"{r['first_result_s']:7.1f}s  {ratio}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
