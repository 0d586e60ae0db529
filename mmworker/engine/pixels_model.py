"""vLLM's Qwen2.5-VL, taught to take `pixels.RawPixels`: the processor passes them through
untouched and the model turns them into the HF processor's float patches on its own device.

Imported by vLLM's model registry (front end and engine core) only when a worker asks for
`pixels.ARCHITECTURE`. Everything else is vLLM's class, unchanged: the HF processor path still
serves the engine's own dummy inputs at start-up and any media not given as `RawPixels`.
Written against the API vLLM 0.25 and 0.3x share (the data parser's per-modality hooks, the
processor's passthrough data, `embed_multimodal`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

import torch
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.parse import ModalityDataItems

from mmworker.engine.pixels import PATCH, TEMPORAL_PATCH, RawPixels

#: Per modality: the key of our raw rows (a key of our own, so that the processor path's uint8
#: patches, which vLLM 0.3x also sends, are never taken for them), the key the model reads its
#: patches from, and the patch grid's key.
_KEYS = {
    "image": ("mmworker_image_rows", "pixel_values", "image_grid_thw"),
    "video": ("mmworker_video_rows", "pixel_values_videos", "video_grid_thw"),
}


class RawPixelItems(ModalityDataItems[list[RawPixels], RawPixels]):
    """Items whose tensors go to the model as they are (vLLM's "passthrough" data): no HF
    processor call and no processor-cache round trip for them."""

    def __init__(self, data: list[RawPixels], modality: str, float_dtype: torch.dtype) -> None:
        super().__init__(data, modality)
        #: vLLM casts every floating tensor the HF processor returns to the model dtype; the
        #: time step is cast the same way so that M-RoPE positions match the processor path.
        self._float_dtype = float_dtype

    def get_count(self) -> int:
        return len(self.data)

    def get(self, index: int) -> RawPixels:
        return self.data[index]

    def get_item_for_hash(self, index: int) -> object:
        return self.data[index].rows

    def get_processor_data(self) -> Mapping[str, object]:
        return {}

    def get_passthrough_data(self) -> Mapping[str, object]:
        rows, _, grid = _KEYS[self.modality]
        out: dict[str, object] = {
            rows: torch.cat([item.rows for item in self.data]),
            grid: torch.tensor([item.grid_thw for item in self.data], dtype=torch.int64),
        }
        if self.modality == "video":
            out["second_per_grid_ts"] = torch.tensor(
                [item.second_per_grid for item in self.data], dtype=torch.float32
            ).to(self._float_dtype)
        return out


def _raw(data: object) -> list[RawPixels] | None:
    if isinstance(data, RawPixels):
        return [data]
    if isinstance(data, list) and data and all(isinstance(d, RawPixels) for d in data):
        return data
    return None


@cache
def _parser_class(base: Any) -> type:
    """`base` (whatever parser class this vLLM release builds for Qwen2.5-VL, with whatever
    arguments) plus the two hooks that recognise `RawPixels`."""

    def _parse_image_data(self: Any, data: Any) -> Any:
        raw = _raw(data)
        if raw:
            return RawPixelItems(raw, "image", self.mmworker_float_dtype)
        return base._parse_image_data(self, data)

    def _parse_video_data(self: Any, data: Any) -> Any:
        raw = _raw(data)
        if raw:
            return RawPixelItems(raw, "video", self.mmworker_float_dtype)
        return base._parse_video_data(self, data)

    return type(
        f"RawPixels{base.__name__}",
        (base,),
        {"_parse_image_data": _parse_image_data, "_parse_video_data": _parse_video_data},
    )


class PixelProcessingInfo(Qwen2_5_VLProcessingInfo):
    def get_data_parser(self) -> Any:
        parser = super().get_data_parser()  # type: ignore[no-untyped-call]
        base: Any = type(parser)
        parser.__class__ = _parser_class(base)
        parser.mmworker_float_dtype = self.ctx.model_config.dtype
        return parser


class PixelProcessor(Qwen2_5_VLMultiModalProcessor):
    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Any) -> Any:
        """Our rows are sliced per item like the processor's patches: by the patch grid."""
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))
        for rows, values, _ in _KEYS.values():
            if rows in hf_inputs:
                fields[rows] = fields[values]
        return fields

    def _hf_processor_applies_updates(self, *args: Any, **kwargs: Any) -> bool:
        """vLLM 0.25 asks whether the HF processor already expanded the placeholders; for
        passthrough pixels it did not (it only saw the text). vLLM 0.3x always expands them
        itself and never calls this."""
        mm_items = kwargs.get("mm_items", args[1] if len(args) > 1 else None)
        if mm_items is not None and any(isinstance(i, RawPixelItems) for i in mm_items.values()):
            return False
        return bool(super()._hf_processor_applies_updates(*args, **kwargs))  # type: ignore[misc]


class Patchify:
    """The HF Qwen2-VL image/video processor's arithmetic, in torch on the model's device.

    `layout` is its `_preprocess` patch order (an image tiled to the temporal patch first), on
    the uint8 bytes; `normalize` is its float32 `(x - mean/rescale) / (std/rescale)`
    (transformers folds the rescale into the mean and std this way)."""

    def __init__(self, mean: list[float], std: list[float], rescale: float, merge: int) -> None:
        self._mean = torch.tensor(mean) * (1.0 / rescale)
        self._std = torch.tensor(std) * (1.0 / rescale)
        self._merge = merge

    def layout(self, rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        image = rows.shape[-1] == PATCH * PATCH * 3  # one frame per patch row
        out = []
        start = 0
        for t, h, w in grid_thw.tolist():
            n = t * h * w
            frames = rows[start : start + n].reshape(-1, h * PATCH, w * PATCH, 3)
            start += n
            frames = frames.permute(0, 3, 1, 2)
            if image:
                frames = frames.repeat_interleave(TEMPORAL_PATCH, dim=0)
            m = self._merge
            x = frames.reshape(t, TEMPORAL_PATCH, 3, h // m, m, PATCH, w // m, m, PATCH)
            x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            out.append(x.reshape(n, 3 * TEMPORAL_PATCH * PATCH * PATCH))
        return torch.cat(out)

    def normalize(self, patches: torch.Tensor) -> torch.Tensor:
        flat = patches.to(torch.float32)
        channels = flat.view(flat.shape[0], 3, -1)
        mean = self._mean.to(flat.device).view(1, 3, 1)
        std = self._std.to(flat.device).view(1, 3, 1)
        return ((channels - mean) / std).view(flat.shape)


def image_statistics(
    model_path: str, revision: str | None
) -> tuple[list[float], list[float], float]:
    """The normalisation the model's own image processor applies (its preprocessor config)."""
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(model_path, revision=revision)  # type: ignore[no-untyped-call]
    return list(proc.image_mean), list(proc.image_std), float(proc.rescale_factor)


@MULTIMODAL_REGISTRY.register_processor(
    PixelProcessor, info=PixelProcessingInfo, dummy_inputs=Qwen2_5_VLDummyInputsBuilder
)
class PixelModel(Qwen2_5_VLForConditionalGeneration):
    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        model = vllm_config.model_config
        mean, std, rescale = image_statistics(model.model, model.revision)
        merge = int(model.hf_config.vision_config.spatial_merge_size)
        self._patchify = Patchify(mean, std, rescale, merge)
        # vLLM 0.3x normalises uint8 patches inside the vision tower itself (its
        # `mm_device_do_normalize`, on by default for this model); 0.25 expects float patches.
        mm_config = model.get_multimodal_config()
        self._tower_normalizes = bool(getattr(mm_config, "mm_device_do_normalize", False))
        self._dtype = model.dtype

    def embed_multimodal(self, **kwargs: object) -> Any:
        for key, values, grid in _KEYS.values():
            rows = kwargs.pop(key, None)
            if rows is None:
                continue
            grid_thw = kwargs[grid]
            assert isinstance(rows, torch.Tensor) and isinstance(grid_thw, torch.Tensor)
            patches = self._patchify.layout(rows, grid_thw)
            if not self._tower_normalizes:
                patches = self._patchify.normalize(patches).to(self._dtype)
            kwargs[values] = patches
        return super().embed_multimodal(**kwargs)
