"""One way to open an in-memory container across the PyAV releases users have.

Tags are never used here, and PyAV up to 18 decodes them strictly unless told otherwise: the
Latin-1 titles of old RealMedia and AVI files raised UnicodeDecodeError (an untyped crash).
PyAV 19 removed the `metadata_errors` option, so it is passed only where it exists.
"""

from __future__ import annotations

import io

import av
from av.container import InputContainer

_STRICT_TAGS_OPTION = int(av.__version__.split(".")[0]) < 19


def open_input(data: bytes) -> InputContainer:
    if _STRICT_TAGS_OPTION:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    container: InputContainer = av.open(io.BytesIO(data), mode="r")
    return container
