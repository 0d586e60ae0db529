"""The pixel path (`engine.pixels_on_engine`, uint8 frames patchified inside the engine) gives the
same answers as vLLM's own processor path, on the real engine and the tiny model.

Both paths serve the same prepared media (one image, two images in one prompt, one video) with
seeded sampling. What this proves is that the path runs end to end in the real engine core and
that prompt lengths (placeholder expansion) and texts agree. The random model's text depends
little on its visual input, so the proof that the encoder sees bit-identical inputs is the unit
test (tests/unit/test_engine_pixels.py), which compares the tensors themselves. This one did
catch a real difference: with frames below the processor's own minimum size the processor path
enlarges them (333 prompt tokens against 65), which the pixel path never does.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from mmworker_preprocess.params import PreparedImage, PreparedVideo
from mmworker_schemas import GenerationParams

from mmworker.config import EngineConfig
from mmworker.engine import Engine, EngineItem
from tests.integration.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(600),
]

_RNG = np.random.default_rng(11)
IMAGE_A = PreparedImage(_RNG.integers(0, 256, (84, 112, 3), dtype=np.uint8), (112, 84))
IMAGE_B = PreparedImage(_RNG.integers(0, 256, (56, 56, 3), dtype=np.uint8), (56, 56))
#: Frames of at least 128 visual tokens: the processor path would enlarge smaller ones (its
#: own minimum), which the pixel path never does.
VIDEO = PreparedVideo(
    frames=_RNG.integers(0, 256, (4, 280, 392, 3), dtype=np.uint8),
    original_size=(392, 280),
    timestamps=(0.0, 0.6, 1.2, 1.8),
    duration_s=2.4,
    source_fps=10.0,
    total_num_frames=24,
    sample_fps=1.7,  # a time step (2 / fps) that is not a round number
)
PROMPTS: dict[str, list[EngineItem]] = {
    "image": [EngineItem(IMAGE_A, "image-a")],
    "two images": [EngineItem(IMAGE_A, "image-a"), EngineItem(IMAGE_B, "image-b")],
    "video": [EngineItem(VIDEO, "video")],
}
PARAMS = GenerationParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)


def _answers(model: Path, pixels_on_engine: bool) -> tuple[bool, dict[str, tuple[str, int]]]:
    async def run() -> tuple[bool, dict[str, tuple[str, int]]]:
        cfg = EngineConfig(
            model=str(model),
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            limit_mm_per_prompt={"image": 2, "video": 1},
            pixels_on_engine=pixels_on_engine,
        )
        engine = Engine(cfg, str(model))
        engine.start()
        try:
            out = {}
            for name, items in PROMPTS.items():
                result = await engine.generate(name, "Describe.", items, PARAMS)
                out[name] = (result.text, result.prompt_tokens)
            return engine.raw_pixels, out
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_the_pixel_path_answers_exactly_as_the_processor_path(tiny_model_dir: Path) -> None:
    raw, on_engine = _answers(tiny_model_dir, pixels_on_engine=True)
    processed, by_processor = _answers(tiny_model_dir, pixels_on_engine=False)
    assert raw and not processed  # each engine took the path it was configured for
    assert on_engine == by_processor
    assert on_engine["video"][1] > on_engine["two images"][1] > on_engine["image"][1]
