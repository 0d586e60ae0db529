"""The real vLLM engine on the tiny model: one image prompt and one video prompt, no mocks.

What this guards: the model directory that ``build_tiny_model`` writes is something vLLM's
Qwen2.5-VL path accepts end to end (processor, placeholder expansion, vision encoder, M-RoPE,
sampling), and the visual-token counts the worker budgets with (``preprocess``) are the ones the
engine actually produces.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from mmworker_preprocess.params import (
    FRAME_FACTOR,
    IMAGE_FACTOR,
    MAX_PIXELS,
    MIN_PIXELS,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
)
from mmworker_preprocess.resize import smart_resize
from PIL import Image

from mmworker.engine.video_metadata import vllm_video_metadata

pytestmark = [
    pytest.mark.integration,
    # vLLM's triton shim touches torch.distributed.reduce_op (deprecated) on first use.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

MAX_TOKENS = 8


def _prompt(llm: Any, kind: str, text: str) -> str:
    """Render through the model's own chat template, as the worker does."""
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": text}]}]
    prompt = llm.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    return prompt


def _sampling() -> Any:
    from vllm import SamplingParams

    # ignore_eos: random weights may emit <|im_end|> at once; the test wants MAX_TOKENS tokens.
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _token_id(llm: Any, token: str) -> int:
    token_id = llm.get_tokenizer().convert_tokens_to_ids(token)
    assert isinstance(token_id, int)
    return token_id


def _check_completion(llm: Any, out: Any) -> None:
    (completion,) = out.outputs
    assert len(completion.token_ids) == MAX_TOKENS
    assert completion.finish_reason == "length"
    vocab = llm.llm_engine.model_config.get_vocab_size()
    assert all(0 <= t < vocab for t in completion.token_ids)
    assert isinstance(completion.text, str)


def test_image_prompt_generates_and_counts_visual_tokens(tiny_llm: Any) -> None:
    # 250×300 is not a multiple of 28, so smart_resize must round: 252×308 → 9×11 = 99 tokens.
    height, width = 250, 300
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    prompt = _prompt(tiny_llm, "image", "Describe this image.")

    (out,) = tiny_llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": Image.fromarray(pixels)}},
        _sampling(),
        use_tqdm=False,
    )

    h, w = smart_resize(height, width, IMAGE_FACTOR, MIN_PIXELS, MAX_PIXELS)
    expected = (h // IMAGE_FACTOR) * (w // IMAGE_FACTOR)
    assert expected == 99
    ids = out.prompt_token_ids
    assert ids.count(_token_id(tiny_llm, "<|image_pad|>")) == expected
    assert ids.count(_token_id(tiny_llm, "<|vision_start|>")) == 1
    text_only = len(tiny_llm.get_tokenizer()(prompt)["input_ids"])
    assert len(ids) == text_only - 1 + expected  # the one placeholder became `expected` tokens
    _check_completion(tiny_llm, out)


def test_video_prompt_with_metadata_generates(tiny_llm: Any) -> None:
    frames, height, width = 8, 112, 168  # T even: frames pair up (temporal patch 2)
    video = np.random.default_rng(1).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    metadata = {
        "fps": 2.0,
        "duration": frames / 2.0,
        "total_num_frames": frames,
        "frames_indices": list(range(frames)),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }
    prompt = _prompt(tiny_llm, "video", "Describe this video.")

    (out,) = tiny_llm.generate(
        {"prompt": prompt, "multi_modal_data": {"video": (video, metadata)}},
        _sampling(),
        use_tqdm=False,
    )

    h, w = smart_resize(height, width, IMAGE_FACTOR, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    expected = (frames // FRAME_FACTOR) * (h // IMAGE_FACTOR) * (w // IMAGE_FACTOR)
    assert out.prompt_token_ids.count(_token_id(tiny_llm, "<|video_pad|>")) == expected
    assert out.prompt_token_ids.count(_token_id(tiny_llm, "<|image_pad|>")) == 0
    _check_completion(tiny_llm, out)


def test_greedy_output_is_reproducible(tiny_llm: Any) -> None:
    """Same image twice (second time through vLLM's processor and prefix caches): same tokens."""
    pixels = np.random.default_rng(2).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    request = {
        "prompt": _prompt(tiny_llm, "image", "Caption."),
        "multi_modal_data": {"image": Image.fromarray(pixels)},
    }
    first, second = tiny_llm.generate([request, request], _sampling(), use_tqdm=False)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


@pytest.mark.parametrize(
    ("height", "width", "max_pixels"),
    [
        (1000, 3000, 28 * 28 * 2),  # a cap below the model's floor: 28×84 would be 3 tokens
        (300, 260, 28 * 28),  # smallest cap a job may ask for
    ],
)
def test_prepared_image_tokens_are_the_engines(
    tiny_llm: Any, height: int, width: int, max_pixels: int
) -> None:
    """Whatever a job asks for, the size preprocess picks is one the engine keeps as is."""
    from mmworker_preprocess.image import prepare_image
    from mmworker_preprocess.params import ImageParams
    from mmworker_preprocess.tokens import image_tokens

    rgb = np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    prepared = prepare_image(buf.getvalue(), ImageParams(min_pixels=28 * 28, max_pixels=max_pixels))
    h, w = prepared.pixels.shape[:2]
    (out,) = tiny_llm.generate(
        {
            "prompt": _prompt(tiny_llm, "image", "Caption."),
            "multi_modal_data": {"image": Image.fromarray(prepared.pixels)},
        },
        _sampling(),
        use_tqdm=False,
    )
    assert out.prompt_token_ids.count(_token_id(tiny_llm, "<|image_pad|>")) == image_tokens(h, w)


def test_prepared_video_tokens_are_the_engines(tiny_llm: Any) -> None:
    """A per-frame cap below the video processor's floor: frames settle at the floor."""
    import media_videos as mv
    from mmworker_preprocess.params import VideoParams
    from mmworker_preprocess.tokens import video_tokens
    from mmworker_preprocess.video import prepare_video

    data = mv.encode_video(width=320, height=96, n_frames=8, fps=4)
    tiny = 28 * 28
    params = VideoParams(fps=4.0, min_frames=4, max_frames=8, min_pixels=tiny, max_pixels=tiny)
    prepared = prepare_video(data, params)
    t, h, w = prepared.frames.shape[:3]
    assert h * w >= VIDEO_MIN_PIXELS
    (out,) = tiny_llm.generate(
        {
            "prompt": _prompt(tiny_llm, "video", "Caption."),
            "multi_modal_data": {"video": (prepared.frames, vllm_video_metadata(prepared))},
        },
        _sampling(),
        use_tqdm=False,
    )
    assert out.prompt_token_ids.count(_token_id(tiny_llm, "<|video_pad|>")) == video_tokens(t, h, w)
