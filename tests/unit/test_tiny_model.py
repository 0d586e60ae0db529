"""The tiny checkpoint loads with transformers' own classes and is internally consistent.

vLLM trusts config.json's special-token ids to find placeholders in the token stream; if they
disagree with the tokenizer, images silently go unencoded. These checks catch that without vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmworker.devkit.tiny_model import SPECIAL_TOKENS, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_ID_FIELDS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def dir_3b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("arch3b") / "model", arch="3b")


def _config(path: Path) -> dict[str, Any]:
    data = json.loads((path / "config.json").read_text())
    assert isinstance(data, dict)
    return data


def _processor(path: Path) -> Any:
    from transformers import AutoProcessor

    auto: Any = AutoProcessor  # untyped in transformers
    return auto.from_pretrained(path)


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_files_and_size(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "chat_template.json",
        "README.md",
    } <= names
    total = sum(p.stat().st_size for p in tiny_dir.iterdir())
    assert total < 8 * 1024 * 1024
    assert "RANDOM WEIGHTS FOR TESTING" in (tiny_dir / "README.md").read_text()


def test_processor_loads_and_ids_agree(tiny_dir: Path) -> None:
    processor = _processor(tiny_dir)
    tokenizer = processor.tokenizer
    config = _config(tiny_dir)
    for field, token in _ID_FIELDS.items():
        assert config[field] == tokenizer.convert_tokens_to_ids(token), field
    text = config["text_config"]
    assert text["vocab_size"] == len(tokenizer)
    assert (
        text["eos_token_id"]
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    assert text["pad_token_id"] == tokenizer.pad_token_id
    assert text["bos_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token_id in generation["eos_token_id"]
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(ids) and all(i < len(tokenizer) for i in ids)
    sample = "A red cat, 2024! <|im_start|>"
    assert tokenizer.decode(tokenizer(sample)["input_ids"]) == sample


def test_chat_template_and_image_tokens(tiny_dir: Path) -> None:
    processor = _processor(tiny_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )
    image = Image.fromarray(np.zeros((224, 336, 3), dtype=np.uint8))
    batch = processor(text=[prompt], images=[image], return_tensors="pt")
    assert batch["image_grid_thw"].tolist() == [[1, 16, 24]]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch["input_ids"] == pad).sum()) == (224 // 28) * (336 // 28)


def test_tiny_architecture(tiny_dir: Path) -> None:
    config = _config(tiny_dir)
    text, vision = config["text_config"], config["vision_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"]) == (
        128,
        2,
        2,
    )
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert (vision["depth"], vision["hidden_size"], vision["out_hidden_size"]) == (2, 64, 128)
    assert vision["out_hidden_size"] == text["hidden_size"]
    assert (vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"]) == (
        14,
        2,
        2,
    )


def test_build_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    assert _digests(build_tiny_model(tmp_path / "again")) == _digests(tiny_dir)
    other = _digests(build_tiny_model(tmp_path / "seed1", seed=1))
    assert other["model.safetensors"] != _digests(tiny_dir)["model.safetensors"]


def test_3b_architecture_without_weights(dir_3b: Path, tiny_dir: Path) -> None:
    assert not list(dir_3b.glob("*.safetensors"))
    assert "RANDOM WEIGHTS FOR TESTING" in (dir_3b / "README.md").read_text()
    config = _config(dir_3b)
    text, vision = config["text_config"], config["vision_config"]
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    expected_text = {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
    }
    assert {k: text[k] for k in expected_text} == expected_text
    assert text["rope_parameters"]["rope_theta"] == 1e6
    assert text["rope_parameters"]["mrope_section"] == [16, 24, 24]
    assert config["tie_word_embeddings"] is True
    expected_vision = {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "hidden_act": "silu",
    }
    assert {k: vision[k] for k in expected_vision} == expected_vision
    # Special ids point into the tiny tokenizer, which both directories share.
    tiny = _config(tiny_dir)
    for field in _ID_FIELDS:
        assert config[field] == tiny[field]
    assert (dir_3b / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(dir_3b)
    assert loaded.get_text_config().num_hidden_layers == 36


def test_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path / "x", arch="7b")  # type: ignore[arg-type]
