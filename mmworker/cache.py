"""Content-addressed cache of preprocessed frames, so a re-sent image or video skips decode+resize.

Decoding and resizing a video costs far more than reading a few MB back from local disk, and
producers do re-send the same media (retries, re-captioning with a new prompt). The key is a hash
of the media bytes' sha256 and the preprocessing parameters (which carry PREPROCESS_VERSION), so a
change to either can never serve stale pixels, and no invalidation is ever needed.

On-disk entry (``<dir>/<key[:2]>/<key>.mmf``, all integers little-endian)::

    offset  size  field
    0       4     magic b"MMFC"
    4       1     format version (1)
    5       1     kind: 0 = image, 1 = video
    6       2     ndim
    8       2     len(dtype)
    10      4     len(meta)
    14      8     len(raw payload)
    22      8     len(compressed payload)
    30      32    sha256 over bytes 0..29, dtype, shape, meta and the *uncompressed* payload
    62      ...   dtype (ASCII numpy dtype.str, e.g. "|u1")
            8*n   shape (uint64 each)
            ...   meta (UTF-8 JSON: the entry's own key, original_size, and for video
                  timestamps/duration/fps...)
            ...   zstd frame of the C-contiguous array bytes

No pickle anywhere: a cache directory is only data, so a tampered file cannot execute code.

The meta names the key the entry was written under, so a file that reaches another key's path
(a copy or restore that renamed files, two directories merged by hand) is dropped as damage
instead of serving one medium's frames for another: the checksum alone proves the file whole,
not that it belongs where it lies. Entries from before the key was recorded have none and are
read as before; the field is only added, so workers of either version share a directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import stat
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import zstandard
from mmworker_preprocess.params import ImageParams, PreparedImage, PreparedVideo, VideoParams
from mmworker_preprocess.video.segments import PreparedSegment

from mmworker.errors import WorkerError

log = logging.getLogger(__name__)

MAGIC = b"MMFC"
FORMAT_VERSION = 1
SUFFIX = ".mmf"
TMP_SUFFIX = ".tmp"
#: A temp file older than this is a crashed write, not one in progress: a write takes seconds, and
#: another worker sharing the directory may be mid-write while this one starts.
STALE_TMP_S = 3600.0
#: Hashed into every key so a future change of key derivation cannot collide with old keys.
_KEY_DOMAIN = "mmworker-feature-cache/1"

_HEADER = struct.Struct("<4sBBHHIQQ")
_DIGEST_LEN = 32
_PREFIX_LEN = _HEADER.size + _DIGEST_LEN
_KIND_IMAGE = 0
_KIND_VIDEO = 1
_Array = npt.NDArray[Any]
_T = TypeVar("_T")
_KEY_RE = re.compile(r"[0-9a-f]{64}")
# Bounds that no sane entry exceeds; they stop a corrupt header from driving huge allocations.
_MAX_NDIM = 8
_MAX_DTYPE_LEN = 32
#: Far above any prepared media (a 768-frame video at Qwen's largest frames is ~0.5 GB of uint8):
#: a larger payload length is damage, and must not be allocated.
_MAX_RAW_BYTES = 4 * 1024**3


class CacheError(WorkerError):
    """Misuse of the cache API (bad key or media hash); never raised for a bad entry on disk."""


class _CorruptEntry(Exception):
    """Internal: an entry failed validation; the caller deletes it and reports a miss."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    writes: int = 0
    evictions: int = 0
    corrupt: int = 0
    #: Puts refused because one entry alone exceeds the byte budget.
    oversized: int = 0
    #: Reads or writes that failed with an OS error (disk full, permissions): treated as misses.
    io_errors: int = 0
    bytes: int = 0
    entries: int = 0


def make_key(media_sha256: str, params: ImageParams | VideoParams) -> str:
    """Derive the cache key; canonical JSON makes it identical across processes and restarts."""
    media = media_sha256.lower()
    if not _KEY_RE.fullmatch(media):
        raise CacheError(f"media_sha256 must be 64 hex chars, got {media_sha256!r}")
    canonical = json.dumps(
        {"domain": _KEY_DOMAIN, "media": media, "params": params.cache_key_fields()},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def segment_key(
    media_sha256: str, params: VideoParams, rule: dict[str, object], start_s: float
) -> str:
    """Key of one segment of a video cut in segment mode: the whole video's key for `params`,
    the cutting rule (with its code version) and where the segment starts. Where it ends is
    decided by the rule and the content, so it is stored in the entry, not keyed."""
    canonical = json.dumps(
        {"video": make_key(media_sha256, params), "rule": rule, "start_s": round(start_s, 6)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


class FeatureCache(Protocol):
    """What the worker depends on, so tests and the disabled mode can swap implementations.

    Getters return None on any miss (absent, corrupt, unreadable); putters never raise for I/O
    problems, because a cache failure must not fail a captioning job. Arrays returned by getters
    may be read-only views.
    """

    def get_image(self, key: str) -> PreparedImage | None: ...
    def put_image(self, key: str, image: PreparedImage) -> None: ...
    def get_video(self, key: str) -> PreparedVideo | None: ...
    def put_video(self, key: str, video: PreparedVideo) -> None: ...
    def get_segment(self, key: str) -> PreparedSegment | None: ...
    def put_segment(self, key: str, segment: PreparedSegment) -> None: ...
    def stats(self) -> CacheStats: ...


class NullFeatureCache:
    """The cache when disabled: always a miss, so call sites stay branch-free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._misses = 0

    def get_image(self, key: str) -> PreparedImage | None:
        self._miss()
        return None

    def put_image(self, key: str, image: PreparedImage) -> None:
        return None

    def get_video(self, key: str) -> PreparedVideo | None:
        self._miss()
        return None

    def put_video(self, key: str, video: PreparedVideo) -> None:
        return None

    def get_segment(self, key: str) -> PreparedSegment | None:
        self._miss()
        return None

    def put_segment(self, key: str, segment: PreparedSegment) -> None:
        return None

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(misses=self._misses)

    def _miss(self) -> None:
        with self._lock:
            self._misses += 1


# ---------------------------------------------------------------------------------------------
# Encoding


def _checksum(prefix: bytes, dtype: bytes, shape: bytes, meta: bytes, raw: Any) -> bytes:
    # sha256 rather than blake2b: with SHA-NI it runs ~2 GB/s here, blake2b about a third of that.
    h = hashlib.sha256(prefix)
    for part in (dtype, shape, meta, raw):
        h.update(part)
    return h.digest()


def _encode(
    kind: int, array: _Array, meta: dict[str, object], cctx: zstandard.ZstdCompressor
) -> bytes:
    arr = np.ascontiguousarray(array)
    if arr.dtype.hasobject:
        raise CacheError("object arrays cannot be cached")
    dtype_b = arr.dtype.str.encode("ascii")
    shape_b = struct.pack(f"<{arr.ndim}Q", *arr.shape)
    meta_b = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode("utf-8")
    raw = arr.reshape(-1).view(np.uint8).data
    comp = cctx.compress(raw)
    head = _HEADER.pack(
        MAGIC, FORMAT_VERSION, kind, arr.ndim, len(dtype_b), len(meta_b), raw.nbytes, len(comp)
    )
    digest = _checksum(head, dtype_b, shape_b, meta_b, raw)
    return b"".join((head, digest, dtype_b, shape_b, meta_b, comp))


def _decode(blob: bytes, dctx: zstandard.ZstdDecompressor) -> tuple[int, _Array, dict[str, Any]]:
    """Parse and verify an entry; every inconsistency raises _CorruptEntry."""
    if len(blob) < _PREFIX_LEN:
        raise _CorruptEntry("shorter than header")
    head = blob[: _HEADER.size]
    magic, version, kind, ndim, dtype_len, meta_len, raw_len, comp_len = _HEADER.unpack(head)
    if magic != MAGIC:
        raise _CorruptEntry(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise _CorruptEntry(f"unknown format version {version}")
    if kind not in (_KIND_IMAGE, _KIND_VIDEO) or ndim > _MAX_NDIM or dtype_len > _MAX_DTYPE_LEN:
        raise _CorruptEntry("implausible header")
    digest = blob[_HEADER.size : _PREFIX_LEN]
    pos = _PREFIX_LEN
    dtype_b = blob[pos : pos + dtype_len]
    pos += dtype_len
    shape_b = blob[pos : pos + 8 * ndim]
    pos += 8 * ndim
    meta_b = blob[pos : pos + meta_len]
    pos += meta_len
    if len(blob) != pos + comp_len:
        raise _CorruptEntry(f"size {len(blob)} != expected {pos + comp_len} (truncated?)")
    try:
        dtype = np.dtype(dtype_b.decode("ascii"))
    except (UnicodeDecodeError, TypeError, ValueError, SyntaxError) as e:
        # numpy parses a damaged dtype string (",u1", "|01") with its own grammar's errors
        raise _CorruptEntry(f"bad dtype {dtype_b!r}") from e
    if dtype != np.uint8:  # what every entry holds: RGB bytes (an odd dtype raised on reshape)
        raise _CorruptEntry(f"dtype {dtype}, not uint8")
    shape = struct.unpack(f"<{ndim}Q", shape_b)
    if len(shape) != (3 if kind == _KIND_IMAGE else 4) or shape[-1] != 3 or 0 in shape:
        raise _CorruptEntry(f"shape {shape} is not H×W×3 or T×H×W×3")
    if math.prod(shape) * dtype.itemsize != raw_len:
        raise _CorruptEntry("shape/dtype disagree with payload length")
    if raw_len > _MAX_RAW_BYTES:
        raise _CorruptEntry(f"implausible payload of {raw_len} bytes")
    try:
        # zstd ignores max_output_size when the frame's header states a content size: one
        # flipped bit there asked for 17.5 TB (MemoryError), before the checksum could tell.
        declared = zstandard.frame_content_size(memoryview(blob)[pos:])
        if declared not in (-1, raw_len):
            raise _CorruptEntry(f"zstd frame declares {declared} bytes, header {raw_len}")
        raw = dctx.decompress(memoryview(blob)[pos:], max_output_size=raw_len)
    except zstandard.ZstdError as e:
        raise _CorruptEntry(f"zstd: {e}") from e
    if len(raw) != raw_len:
        raise _CorruptEntry("decompressed length mismatch")
    if _checksum(head, dtype_b, shape_b, meta_b, raw) != digest:
        raise _CorruptEntry("checksum mismatch")
    try:
        meta = json.loads(meta_b)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise _CorruptEntry("bad meta JSON") from e
    if not isinstance(meta, dict):
        raise _CorruptEntry("meta is not an object")
    # Zero-copy view of the decompressed bytes, hence read-only: cached frames are shared inputs
    # and must not be mutated in place anyway.
    return kind, np.frombuffer(raw, dtype=dtype).reshape(shape), meta


def _size_pair(value: Any) -> tuple[int, int]:
    w, h = value
    return (int(w), int(h))


def _build_image(pixels: _Array, meta: dict[str, Any]) -> PreparedImage:
    return PreparedImage(pixels=pixels, original_size=_size_pair(meta["original_size"]))


def _build_video(frames: _Array, m: dict[str, Any]) -> PreparedVideo:
    return PreparedVideo(
        frames=frames,
        original_size=_size_pair(m["original_size"]),
        timestamps=tuple(float(t) for t in m["timestamps"]),
        duration_s=float(m["duration_s"]),
        source_fps=float(m["source_fps"]),
        total_num_frames=int(m["total_num_frames"]),
        sample_fps=float(m["sample_fps"]),
        # Entries written before partial videos existed are whole videos.
        partial=bool(m.get("partial", False)),
        full_duration_s=None if m.get("full_duration_s") is None else float(m["full_duration_s"]),
    )


def _video_meta(video: PreparedVideo) -> dict[str, object]:
    return {
        "original_size": list(video.original_size),
        "timestamps": list(video.timestamps),
        "duration_s": video.duration_s,
        "source_fps": video.source_fps,
        "total_num_frames": video.total_num_frames,
        "sample_fps": video.sample_fps,
        "partial": video.partial,
        "full_duration_s": video.full_duration_s,
    }


def _build_segment(frames: _Array, m: dict[str, Any]) -> PreparedSegment:
    """A segment is stored as a video entry plus its bounds (`segment` in the meta)."""
    seg = m["segment"]
    return PreparedSegment(
        start_s=float(seg["start_s"]),
        end_s=float(seg["end_s"]),
        video=_build_video(frames, m),
        last=bool(seg["last"]),
        scene_cut=bool(seg["scene_cut"]),
    )


class _Codecs(threading.local):
    """zstd contexts are not thread-safe but are costly to create, so keep one pair per thread."""

    def __init__(self, level: int) -> None:
        self.cctx = zstandard.ZstdCompressor(level=level)
        self.dctx = zstandard.ZstdDecompressor()


# ---------------------------------------------------------------------------------------------
# Disk cache


class DiskFeatureCache:
    """LRU-by-bytes cache of encoded entries in a local directory.

    The in-memory index mirrors the directory so eviction needs no directory scan; disk stays the
    source of truth (a missing file is just a miss). Recency is also written to the file mtime so
    the LRU order survives restarts. Several processes may share a directory safely (atomic
    renames, tolerant of files vanishing), but each enforces the budget over its own view only:
    the entries it writes, and of those on disk when it starts, its `part` (i, N), the keys in
    the i-th of N equal shares. Each process of N then starts with its share of the directory
    and its share of the budget; indexing all of it, each evicted the directory down to its
    share at every start (half of a warm cache gone at each restart of two processes).
    """

    def __init__(
        self, directory: Path, max_bytes: int, zstd_level: int = 3, *, fsync: bool = False,
        part: tuple[int, int] = (0, 1),
    ) -> None:  # fmt: skip
        if max_bytes <= 0:
            raise CacheError("max_bytes must be positive")
        if not 0 <= part[0] < part[1]:
            raise CacheError(f"part {part}: the i-th of N shares, 0 <= i < N")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.part = part
        self.fsync = fsync
        self._codecs = _Codecs(zstd_level)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key → size; oldest first
        self._bytes = 0
        self._hits = self._misses = self._writes = 0
        self._evictions = self._corrupt = self._oversized = self._io_errors = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._load_index()

    # -- public API ----------------------------------------------------------------------------

    def get_image(self, key: str) -> PreparedImage | None:
        return self._get(key, _KIND_IMAGE, _build_image)

    def put_image(self, key: str, image: PreparedImage) -> None:
        meta: dict[str, object] = {"original_size": list(image.original_size)}
        self._put(key, _KIND_IMAGE, image.pixels, meta)

    def get_video(self, key: str) -> PreparedVideo | None:
        return self._get(key, _KIND_VIDEO, _build_video)

    def put_video(self, key: str, video: PreparedVideo) -> None:
        self._put(key, _KIND_VIDEO, video.frames, _video_meta(video))

    def get_segment(self, key: str) -> PreparedSegment | None:
        return self._get(key, _KIND_VIDEO, _build_segment)

    def put_segment(self, key: str, segment: PreparedSegment) -> None:
        meta = _video_meta(segment.video)
        meta["segment"] = {
            "start_s": segment.start_s,
            "end_s": segment.end_s,
            "last": segment.last,
            "scene_cut": segment.scene_cut,
        }
        self._put(key, _KIND_VIDEO, segment.video.frames, meta)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                hits=self._hits,
                misses=self._misses,
                writes=self._writes,
                evictions=self._evictions,
                corrupt=self._corrupt,
                oversized=self._oversized,
                io_errors=self._io_errors,
                bytes=self._bytes,
                entries=len(self._index),
            )

    def path_for(self, key: str) -> Path:
        """Sharded by prefix so no single directory grows to hundreds of thousands of files."""
        if not _KEY_RE.fullmatch(key):
            raise CacheError(f"cache key must be 64 lowercase hex chars, got {key!r}")
        return self.directory / key[:2] / f"{key}{SUFFIX}"

    # -- internals -----------------------------------------------------------------------------

    def _load_index(self) -> None:
        found: list[tuple[float, str, int]] = []
        for shard in self.directory.iterdir():
            if not (shard.is_dir() and len(shard.name) == 2):
                continue
            for f in shard.iterdir():
                if f.name.endswith(TMP_SUFFIX):
                    # Never visible as an entry; removed only once surely abandoned.
                    with contextlib.suppress(OSError):  # gone, or a read-only cache
                        if time.time() - f.stat().st_mtime > STALE_TMP_S:
                            f.unlink()
                    continue
                key = f.name.removesuffix(SUFFIX)
                if f.suffix != SUFFIX or not _KEY_RE.fullmatch(key) or key[:2] != shard.name:
                    continue
                if int(key[:8], 16) % self.part[1] != self.part[0]:
                    continue  # another process's share
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._bytes += size
            self._evict_locked()

    def _get(self, key: str, kind: int, build: Callable[[_Array, dict[str, Any]], _T]) -> _T | None:
        path = self.path_for(key)
        try:
            with path.open("rb") as fh:
                ino = os.fstat(fh.fileno()).st_ino
                blob = fh.read()
        except FileNotFoundError:
            with self._lock:
                self._misses += 1
                if not path.exists():  # a put may have re-created it since we looked
                    self._forget_locked(key)
            return None
        except OSError as e:
            log.warning("feature cache: cannot read %s: %s", path, e)
            with self._lock:
                self._misses += 1
                self._io_errors += 1
            return None
        try:
            got_kind, array, meta = _decode(blob, self._codecs.dctx)
            if got_kind != kind:  # keys embed the kind, so this is damage, not a valid entry
                raise _CorruptEntry(f"entry kind {got_kind}, wanted {kind}")
            if meta.get("key", key) != key:  # the value is left out: any JSON could sit there
                raise _CorruptEntry("written under another key")
            try:
                value = build(array, meta)
            except (KeyError, TypeError, ValueError, OverflowError) as e:  # 1e999 as an int
                raise _CorruptEntry(f"bad meta: {e!r}") from e
        except _CorruptEntry as e:
            log.warning("feature cache: dropping corrupt entry %s: %s", path, e)
            with self._lock:
                self._corrupt += 1
                self._misses += 1
                # Only delete the file we read: a concurrent put may already have replaced it.
                if _same_file(path, ino):
                    # Another process sharing the directory may have dropped it first; a
                    # read-only directory keeps it. Either way this job just misses.
                    with contextlib.suppress(OSError):
                        path.unlink()
                if not path.exists():
                    self._forget_locked(key)
            return None
        with self._lock:
            self._hits += 1
            if key in self._index:
                self._index.move_to_end(key)
            elif _same_file(path, ino):
                # Written by another process sharing the directory. Checked under the lock: a
                # thread here may have evicted it since we read it, and the index must not
                # list a file that is gone.
                self._index[key] = len(blob)
                self._bytes += len(blob)
        with contextlib.suppress(OSError):  # gone, or a read-only cache: the hit still counts
            os.utime(path)  # recency for the next start's index rebuild
        return value

    def _put(self, key: str, kind: int, array: _Array, meta: dict[str, object]) -> None:
        """Best-effort: an I/O failure is logged and counted, never fails the caller's job."""
        path = self.path_for(key)
        with self._lock:
            # Content-addressed: an existing entry already holds these exact frames.
            if key in self._index:
                self._index.move_to_end(key)
                return
        blob = _encode(kind, array, {**meta, "key": key}, self._codecs.cctx)
        if len(blob) > self.max_bytes:
            with self._lock:
                self._oversized += 1
            return
        # Temp file in the same directory so os.replace is an atomic rename: readers and a crash
        # see either no entry or the whole entry, never a prefix of it.
        tmp = path.parent / f".{key}.{uuid.uuid4().hex}{TMP_SUFFIX}"
        try:
            path.parent.mkdir(exist_ok=True)
            with tmp.open("wb") as fh:
                fh.write(blob)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            with self._lock:
                os.replace(tmp, path)
                self._forget_locked(key)
                self._index[key] = len(blob)
                self._bytes += len(blob)
                self._writes += 1
                self._evict_locked()
            if self.fsync:
                _fsync_dir(path.parent)
        except OSError as e:
            log.warning("feature cache: cannot write %s: %s", path, e)
            with self._lock:
                self._io_errors += 1
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _forget_locked(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _evict_locked(self) -> None:
        while self._bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            self._evictions += 1
            with contextlib.suppress(OSError):  # gone, or a read-only cache: out of the index
                self.path_for(key).unlink()


def _same_file(path: Path, ino: int) -> bool:
    try:
        return path.stat().st_ino == ino
    except FileNotFoundError:
        return False


def _fsync_dir(directory: Path) -> None:
    """Makes the rename itself durable; without it a power loss can forget the new entry."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune_lru_files(
    root: Path,
    max_bytes: int,
    keep_recent_s: float = 300.0,
    kept: Callable[[int], object] | None = None,
) -> int:
    """Delete the least recently used files under `root` until the rest fit in `max_bytes`.

    For stores written by other processes (vLLM's encoder outputs), where no in-process index
    exists: recency is the mtime, which a hit refreshes. Files used within `keep_recent_s` stay
    even over budget, because a reader may have just decided to load them. Returns bytes freed;
    `kept` is told the bytes that remain (the store's size, without a second walk).
    """
    entries = []
    for path in root.rglob("*"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    now, freed = time.time(), 0
    for mtime, size, path in sorted(entries):
        if total <= max_bytes or now - mtime < keep_recent_s:
            break
        path.unlink(missing_ok=True)
        if path.parent != root:
            with contextlib.suppress(OSError):  # not empty: another file was just written there
                path.parent.rmdir()
        total -= size
        freed += size
    if kept is not None:
        kept(total)
    return freed
