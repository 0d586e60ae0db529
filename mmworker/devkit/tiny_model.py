"""A random-weight Qwen2.5-VL checkpoint built offline, so tests and demos run the real engine.

The worker's tests must exercise vLLM's real multimodal path (processor, vision encoder, M-RoPE,
prefix cache) on a 2-core machine with no access to the Hugging Face Hub. A model with the real
Qwen2.5-VL layout but tiny sizes does that in seconds: same config classes, same special tokens,
same chat template and image/video processors, only the widths, depths and vocabulary shrink.

``arch="3b"`` writes the real 3B architecture (Qwen2.5-VL-3B-Instruct's config: 36 layers of
width 2048, a 32-block vision tower) with the tiny tokenizer and no weights, for vLLM's
``load_format="dummy"`` benchmarks on a GPU host that cannot download either.
Its vocabulary stays 151936 (the embedding shape is part of the cost being measured), so generated
ids can exceed the tiny tokenizer's range; vLLM 0.32 decodes those to empty text (checked on CPU
with ``load_format="dummy"``), and ``SamplingParams(detokenize=False)`` skips that work.

Everything is derived from ``seed``: two builds with the same seed are byte-identical.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Literal

__all__ = ["SPECIAL_TOKENS", "build_tiny_model"]

#: Qwen2.5's added tokens in Qwen's order; the first 14 are special (stripped when decoding).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
_PLAIN_ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
_BPE_VOCAB_SIZE = 500

#: Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX), so the tiny
#: tokenizer cuts text exactly where Qwen's does.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: Qwen2.5-VL-Instruct's chat template, verbatim: vLLM's chat path and the processor insert the
#: vision placeholders from it, so a different template would test a different prompt layout.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
_IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
_IMAGE_MIN_PIXELS = 4 * 28 * 28
_IMAGE_MAX_PIXELS = 16384 * 28 * 28
_VIDEO_MIN_PIXELS = 128 * 28 * 28
_VIDEO_MAX_PIXELS = 768 * 28 * 28

_CAPTION_TEXT = (
    "a an the of in on at with and near under over behind beside while this that there is "
    "are photo image picture video frame scene shot view close up wide angle showing shows "
    "depicts red green blue yellow white black gray brown orange purple pink dark bright "
    "light colorful small large tall short old young wooden metal glass stone plastic empty "
    "busy quiet sunny cat dog bird horse cow person people man woman child children car bus "
    "truck bicycle boat tree trees flower grass house building street road bridge river lake "
    "beach mountain sky cloud clouds table chair window door room kitchen city park field "
    "forest snow rain night sitting standing walking running playing holding looking eating "
    "riding parked flying"
)
_CAPTION_WORDS = tuple(_CAPTION_TEXT.split())
_TEMPLATE_LINES = (
    "system\nYou are a helpful assistant.",
    "user\nDescribe this image.",
    "user\nDescribe this video.",
    "assistant\nThe image shows",
    "Write a short caption for the picture.",
)


def _training_text(seed: int) -> list[str]:
    """Caption-like sentences plus made-up syllable words, so BPE finds ~250 merges."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    lines = list(_TEMPLATE_LINES)
    for _ in range(3000):
        words = [rng.choice(_CAPTION_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.5:
            invented = "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4)))
            words.insert(rng.randrange(len(words) + 1), invented)
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 2025)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", ",", "!", "?", ":"]))
    return lines


def _train_tokenizer(seed: int) -> Any:
    """Byte-level BPE with Qwen2's normaliser, pre-tokenizer and decoder, then Qwen's added tokens.

    Byte-level means any text round-trips, as with Qwen's real 151k vocabulary.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(
        BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_training_text(seed), trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in _PLAIN_ADDED_TOKENS]
    )
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    """Qwen2.5-VL-Instruct's tokenizer_config.json layout with the tiny tokenizer's ids."""
    decoder = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in (*SPECIAL_TOKENS, *_PLAIN_ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "bos_token": None,
        # Older transformers read the template from here; 5.x reads chat_template.jinja.
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "processor_class": "Qwen2_5_VLProcessor",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _preprocessor_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    """Image and video processor configs in the per-file layout both transformers 4.5x and 5 read.

    ``min_pixels``/``max_pixels`` are the names older releases and qwen-vl-utils look for; ``size``
    is what transformers 5 uses. Both say the same thing.
    """
    common: dict[str, Any] = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": _IMAGE_MEAN,
        "image_std": _IMAGE_STD,
        "merge_size": 2,
        "patch_size": 14,
        "processor_class": "Qwen2_5_VLProcessor",
        "resample": 3,  # PIL BICUBIC
        "rescale_factor": 1 / 255,
        "temporal_patch_size": 2,
    }
    image = {
        **common,
        "image_processor_type": "Qwen2VLImageProcessor",
        "max_pixels": _IMAGE_MAX_PIXELS,
        "min_pixels": _IMAGE_MIN_PIXELS,
        "size": {"longest_edge": _IMAGE_MAX_PIXELS, "shortest_edge": _IMAGE_MIN_PIXELS},
    }
    video = {
        **common,
        "do_sample_frames": False,
        "max_frames": 768,
        "min_frames": 4,
        "size": {"longest_edge": _VIDEO_MAX_PIXELS, "shortest_edge": _VIDEO_MIN_PIXELS},
        "video_processor_type": "Qwen2VLVideoProcessor",
    }
    return image, video


def _model_config(arch: Literal["tiny", "3b"], ids: dict[str, int], vocab_size: int) -> Any:
    from transformers import Qwen2_5_VLConfig

    token_ids = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    text_ids = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    if arch == "tiny":
        # head_dim = 128 / 2 = 64, so M-RoPE sections must sum to 64 / 2 = 32.
        text: dict[str, Any] = {
            "vocab_size": vocab_size,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [8, 12, 12],
            },
            "max_window_layers": 2,
        }
        vision: dict[str, Any] = {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 128,
            # Block 1 uses full attention, block 0 windowed: both code paths run in tests.
            "fullatt_block_indexes": [1],
        }
        dtype = "float32"
    else:
        # Qwen2.5-VL-3B-Instruct's published config; head_dim 2048 / 16 = 128 → sections sum to 64.
        text = {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128000,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [16, 24, 24],
            },
            "max_window_layers": 70,
        }
        vision = {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": 2048,
            "fullatt_block_indexes": [7, 15, 23, 31],
        }
        dtype = "bfloat16"
    text |= {
        **text_ids,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "dtype": dtype,
    }
    vision |= {
        "hidden_act": "silu",
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "tokens_per_second": 2,
    }
    kwargs: dict[str, Any] = {
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": True,
        **token_ids,
    }
    config = Qwen2_5_VLConfig(**kwargs)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    config.dtype = dtype
    return config


_README = """\
# {name}: RANDOM WEIGHTS FOR TESTING

This directory was generated by
`mmworker.devkit.tiny_model.build_tiny_model(arch="{arch}", seed={seed})`.
{what}

It has the file layout, config classes, special tokens, chat template and image/video processors
of Qwen2.5-VL-Instruct, but its tokenizer is a {vocab}-token byte-level BPE trained on generated
text. Its outputs are meaningless. Do not use it for anything but tests and benchmarks.
"""


def build_tiny_model(out_dir: Path, arch: Literal["tiny", "3b"] = "tiny", seed: int = 0) -> Path:
    """Write a Qwen2.5-VL model directory loadable by vLLM and ``AutoProcessor``; returns it.

    ``tiny`` holds random float32 weights (~3 MB, ``torch.manual_seed(seed)``); ``3b`` holds the
    3B config and no weights, for ``load_format="dummy"``. Needs no network.
    """
    if arch not in ("tiny", "3b"):
        raise ValueError(f"arch must be 'tiny' or '3b', not {arch!r}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-", dir=out_dir.parent) as tmp:
        _write_model_files(Path(tmp), arch, seed)
        _publish(Path(tmp), out_dir)
    return out_dir


def ensure_tiny_model(cache_dir: Path) -> Path:
    """Build the `engine.model = "tiny"` model under the model cache once; later calls find it."""
    from mmworker.config import tiny_model_dir

    target = tiny_model_dir(cache_dir)
    if not (target / "config.json").exists():
        build_tiny_model(target)
    return target


def _publish(staging: Path, out_dir: Path) -> None:
    """Move the finished files in, config.json last.

    Callers (``ensure_tiny_model``) take an existing config.json to mean "complete",
    so an interrupted build must never leave one behind next to missing weights.
    """
    out_dir.mkdir(exist_ok=True)
    names = sorted(p.name for p in staging.iterdir())
    names.sort(key=lambda n: n == "config.json")
    for name in names:
        os.replace(staging / name, out_dir / name)


def _write_model_files(out_dir: Path, arch: Literal["tiny", "3b"], seed: int) -> None:
    import transformers
    from transformers import GenerationConfig

    hf_logging: Any = transformers.utils.logging  # untyped module: keep mypy's checks elsewhere
    generation_config: Any = GenerationConfig

    tokenizer = _train_tokenizer(seed)
    ids = {t: tokenizer.token_to_id(t) for t in (*SPECIAL_TOKENS, *_PLAIN_ADDED_TOKENS)}
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = _model_config(arch, ids, vocab_size)

    # Silence init/save chatter and the "Writing model shards" bar: callers own the terminal.
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        if arch == "tiny":
            _write_weights(config, out_dir, seed)
        config.save_pretrained(out_dir)
        generation_config(
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
            pad_token_id=ids["<|endoftext|>"],
            do_sample=False,
        ).save_pretrained(out_dir)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()

    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(ids))
    image_cfg, video_cfg = _preprocessor_configs()
    _write_json(out_dir / "preprocessor_config.json", image_cfg)
    _write_json(out_dir / "video_preprocessor_config.json", video_cfg)
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    what = (
        f"Random weights from torch.manual_seed({seed}), float32."
        if arch == "tiny"
        else "The Qwen2.5-VL-3B architecture with NO weights: load it with vLLM's "
        'load_format="dummy". Its vocab_size (151936) exceeds the tokenizer\'s: ids beyond it '
        "decode to empty text."
    )
    name = "tiny-qwen2.5-vl" if arch == "tiny" else "qwen2.5-vl-3b-architecture"
    (out_dir / "README.md").write_text(
        _README.format(name=name, arch=arch, seed=seed, what=what, vocab=vocab_size)
    )
    for path in out_dir.iterdir():
        path.chmod(0o644)  # save_pretrained leaves the weights 0600; the dir may be shared


def _write_weights(config: Any, out_dir: Path, seed: int) -> None:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model_class: Any = Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    # save_pretrained wrote these too; the caller writes the canonical ones.
    for stale in ("config.json", "generation_config.json"):
        (out_dir / stale).unlink(missing_ok=True)
