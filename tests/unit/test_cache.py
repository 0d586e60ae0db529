from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mmworker_preprocess.params import (
    PREPROCESS_VERSION,
    ImageParams,
    PreparedImage,
    PreparedVideo,
    VideoParams,
)

from mmworker.cache import (
    STALE_TMP_S,
    CacheError,
    DiskFeatureCache,
    FeatureCache,
    NullFeatureCache,
    make_key,
)
from mmworker.engine.video_metadata import vllm_video_metadata

MB = 1024 * 1024


def media_hash(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def key_for(name: str) -> str:
    return make_key(media_hash(name), ImageParams())


def noise_image(seed: int, size: int = 56) -> PreparedImage:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return PreparedImage(pixels=pixels, original_size=(size * 3 + seed, size * 2))


def sample_video() -> PreparedVideo:
    frames = np.random.default_rng(7).integers(0, 256, (4, 28, 56, 3), dtype=np.uint8)
    return PreparedVideo(
        frames=frames,
        original_size=(1920, 1080),
        timestamps=(0.0, 0.1, 1 / 3, 2.5000000000000004),
        duration_s=12.345678901234567,
        source_fps=29.97002997002997,
        total_num_frames=370,
        sample_fps=0.5,
    )


def entry_size(c: DiskFeatureCache, key: str) -> int:
    return c.path_for(key).stat().st_size


def files_in(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


# -- round trips -------------------------------------------------------------------------------


def test_image_round_trip(tmp_path: Path) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    img = noise_image(1)
    key = key_for("a")
    assert c.get_image(key) is None
    c.put_image(key, img)
    got = c.get_image(key)
    assert got is not None
    assert got.pixels.dtype == np.uint8
    assert np.array_equal(got.pixels, img.pixels)
    assert got.original_size == img.original_size
    s = c.stats()
    assert (s.hits, s.misses, s.writes, s.entries) == (1, 1, 1, 1)
    assert s.bytes == entry_size(c, key)


def test_video_round_trip_exact_metadata(tmp_path: Path) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    video = sample_video()
    key = make_key(media_hash("v"), VideoParams())
    c.put_video(key, video)
    got = c.get_video(key)
    assert got is not None
    assert np.array_equal(got.frames, video.frames)
    assert got.frames.shape == video.frames.shape
    # Everything but the array compares exactly, floats bit-for-bit included.
    assert got.original_size == video.original_size
    assert got.timestamps == video.timestamps
    assert got.duration_s == video.duration_s
    assert got.source_fps == video.source_fps
    assert got.total_num_frames == video.total_num_frames
    assert got.sample_fps == video.sample_fps
    assert vllm_video_metadata(got) == vllm_video_metadata(video)
    assert got.partial is False and got.full_duration_s is None


def test_a_partial_video_stays_partial_on_a_cache_hit(tmp_path: Path) -> None:
    import dataclasses

    c = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    video = dataclasses.replace(sample_video(), partial=True, full_duration_s=6.0)
    key = make_key(media_hash("cut"), VideoParams())
    c.put_video(key, video)
    got = c.get_video(key)
    assert got is not None
    assert got.partial is True and got.full_duration_s == 6.0


def test_non_contiguous_input_round_trips(tmp_path: Path) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    base = np.random.default_rng(3).integers(0, 256, (56, 112, 3), dtype=np.uint8)
    img = PreparedImage(pixels=base[:, ::2], original_size=(10, 20))
    assert not img.pixels.flags.c_contiguous
    c.put_image(key_for("nc"), img)
    got = c.get_image(key_for("nc"))
    assert got is not None and np.array_equal(got.pixels, img.pixels)


def test_compression_shrinks_compressible_array(tmp_path: Path) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    ramp = np.broadcast_to(np.arange(224, dtype=np.uint8)[None, :, None], (224, 224, 3))
    c.put_image(key_for("ramp"), PreparedImage(pixels=ramp.copy(), original_size=(224, 224)))
    assert entry_size(c, key_for("ramp")) < ramp.nbytes // 20


# -- keys --------------------------------------------------------------------------------------


def test_key_changes_with_params_and_media() -> None:
    base = make_key(media_hash("x"), ImageParams())
    assert base == make_key(media_hash("x"), ImageParams())
    assert base != make_key(media_hash("y"), ImageParams())
    assert base != make_key(media_hash("x"), ImageParams(max_pixels=1024 * 28 * 28))
    assert base != make_key(media_hash("x"), VideoParams())
    assert make_key(media_hash("x"), VideoParams()) != make_key(
        media_hash("x"), VideoParams(fps=1.0)
    )
    assert len(base) == 64 and all(ch in "0123456789abcdef" for ch in base)


def test_key_is_canonical_sorted_json_hash() -> None:
    params = VideoParams(strategy="interval", interval_s=2.5)
    media = media_hash("canon")
    fields = params.cache_key_fields()
    assert fields["v"] == PREPROCESS_VERSION
    canonical = json.dumps(
        {"domain": "mmworker-feature-cache/1", "media": media, "params": fields},
        sort_keys=True,
        separators=(",", ":"),
    )
    assert make_key(media, params) == hashlib.sha256(canonical.encode()).hexdigest()
    # Hex case of the media hash must not split one medium into two entries.
    assert make_key(media.upper(), params) == make_key(media, params)


def test_key_is_stable_across_processes() -> None:
    code = (
        "from mmworker.cache import make_key\n"
        "from mmworker_preprocess.params import ImageParams, VideoParams\n"
        "print(make_key('ab' * 32, ImageParams()), make_key('cd' * 32, VideoParams(fps=1.5)))\n"
    )
    # A different hash seed proves no dict/set ordering or hash() leaks into the key.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    here = [make_key("ab" * 32, ImageParams()), make_key("cd" * 32, VideoParams(fps=1.5))]
    assert out.stdout.split() == here


@pytest.mark.parametrize("bad", ["", "abc", "g" * 64, "ab" * 33])
def test_make_key_rejects_non_sha256(bad: str) -> None:
    with pytest.raises(CacheError):
        make_key(bad, ImageParams())


@pytest.mark.parametrize("bad", ["../" + "a" * 61, "A" * 64, "a" * 63, "a" * 64 + "/x"])
def test_malformed_key_rejected_before_touching_disk(tmp_path: Path, bad: str) -> None:
    c = DiskFeatureCache(tmp_path / "c", max_bytes=MB)
    with pytest.raises(CacheError):
        c.get_image(bad)
    with pytest.raises(CacheError):
        c.put_image(bad, noise_image(0))
    assert files_in(tmp_path) == []


# -- persistence and eviction ------------------------------------------------------------------


def test_entries_survive_restart(tmp_path: Path) -> None:
    c1 = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    img = noise_image(2)
    c1.put_image(key_for("p"), img)
    c1.put_video(make_key(media_hash("p"), VideoParams()), sample_video())
    c2 = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    assert c2.stats().entries == 2
    assert c2.stats().bytes == c1.stats().bytes
    got = c2.get_image(key_for("p"))
    assert got is not None and np.array_equal(got.pixels, img.pixels)
    assert c2.get_video(make_key(media_hash("p"), VideoParams())) is not None


def test_files_are_sharded_by_key_prefix(tmp_path: Path) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=MB)
    key = key_for("shard")
    c.put_image(key, noise_image(0))
    assert files_in(tmp_path) == [tmp_path / key[:2] / f"{key}.mmf"]


def test_lru_evicts_least_recently_used_within_budget(tmp_path: Path) -> None:
    probe = DiskFeatureCache(tmp_path / "probe", max_bytes=10 * MB)
    probe.put_image(key_for("probe"), noise_image(0))
    size = entry_size(probe, key_for("probe"))
    # Same-shape noise entries are all within a few bytes of each other; room for two, not three.
    c = DiskFeatureCache(tmp_path / "c", max_bytes=2 * size + size // 2)
    a, b, d = key_for("a"), key_for("b"), key_for("d")
    c.put_image(a, noise_image(1))
    c.put_image(b, noise_image(2))
    assert c.get_image(a) is not None  # a is now more recent than b
    c.put_image(d, noise_image(3))
    assert not c.path_for(b).exists()
    assert c.get_image(b) is None
    assert c.get_image(a) is not None and c.get_image(d) is not None
    s = c.stats()
    assert s.evictions == 1 and s.entries == 2
    assert s.bytes <= c.max_bytes
    assert s.bytes == sum(p.stat().st_size for p in files_in(tmp_path / "c"))


def test_recency_from_hits_survives_restart(tmp_path: Path) -> None:
    c1 = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    a, b = key_for("a"), key_for("b")
    c1.put_image(a, noise_image(1))
    c1.put_image(b, noise_image(2))
    # Pin old, ordered mtimes (a older than b) so the test doesn't depend on clock granularity.
    os.utime(c1.path_for(a), (1_000_000, 1_000_000))
    os.utime(c1.path_for(b), (2_000_000, 2_000_000))
    assert c1.get_image(a) is not None  # must refresh a's mtime to "now"
    assert c1.path_for(a).stat().st_mtime > 2_000_000
    size = max(entry_size(c1, a), entry_size(c1, b))
    c2 = DiskFeatureCache(tmp_path, max_bytes=2 * size + size // 2)
    c2.put_image(key_for("c"), noise_image(3))
    assert c2.path_for(a).exists()
    assert not c2.path_for(b).exists()


def test_startup_evicts_down_to_a_smaller_budget(tmp_path: Path) -> None:
    c1 = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    keys = [key_for(str(i)) for i in range(4)]
    for i, k in enumerate(keys):
        c1.put_image(k, noise_image(i))
        os.utime(c1.path_for(k), (1_000_000 + i, 1_000_000 + i))
    size = max(entry_size(c1, k) for k in keys)
    c2 = DiskFeatureCache(tmp_path, max_bytes=size + size // 2)
    assert [c2.path_for(k).exists() for k in keys] == [False, False, False, True]
    assert c2.stats().evictions == 3 and c2.stats().entries == 1


def test_processes_sharing_the_directory_start_with_their_share_not_an_eviction(
    tmp_path: Path,
) -> None:
    """With processes = 2, each process had half the budget and indexed the whole directory:
    every start evicted a full cache down to half."""
    keys = [key_for(str(i)) for i in range(24)]
    full = DiskFeatureCache(tmp_path, max_bytes=10 * MB)
    for i, k in enumerate(keys):
        full.put_image(k, noise_image(i))
    # The directory full for one process; a share of the keys is about half of it (here 10 and
    # 14 entries, within the slack).
    budget = sum(entry_size(full, k) for k in keys) * 12 // 10
    halves = [DiskFeatureCache(tmp_path, max_bytes=budget // 2, part=(i, 2)) for i in range(2)]
    assert all(full.path_for(k).exists() for k in keys)  # nothing evicted
    assert sum(h.stats().evictions for h in halves) == 0
    assert sum(h.stats().entries for h in halves) == len(keys)  # each entry counted once
    assert all(h.stats().entries > 0 for h in halves)
    assert all(h.get_image(k) is not None for h in halves for k in keys)  # any serves any
    with pytest.raises(CacheError):
        DiskFeatureCache(tmp_path, max_bytes=MB, part=(2, 2))


def test_oversized_entry_is_not_stored(tmp_path: Path) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=1000)
    small = PreparedImage(pixels=np.zeros((28, 28, 3), np.uint8), original_size=(28, 28))
    c.put_image(key_for("small"), small)
    c.put_image(key_for("big"), noise_image(0, size=112))  # ~37 KB of noise
    assert c.get_image(key_for("big")) is None
    assert not c.path_for(key_for("big")).exists()
    # Refusing the big one must not have evicted what was already there.
    assert c.get_image(key_for("small")) is not None
    s = c.stats()
    assert s.oversized == 1 and s.evictions == 0 and s.entries == 1


def test_put_of_existing_key_is_not_rewritten(tmp_path: Path) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=MB)
    c.put_image(key_for("k"), noise_image(1))
    c.put_image(key_for("k"), noise_image(1))
    assert c.stats().writes == 1
    assert len(files_in(tmp_path)) == 1


# -- corruption and crashes --------------------------------------------------------------------


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def flip_meta_byte(data: bytes) -> bytes:
    # The meta JSON holds original_size; changing a digit keeps it valid JSON, so only the
    # checksum can notice.
    i = data.index(b'"original_size":[') + len(b'"original_size":[')
    return data[:i] + (b"9" if data[i : i + 1] != b"9" else b"8") + data[i + 1 :]


def flip_frame_descriptor(data: bytes) -> bytes:
    i = data.index(b"\x28\xb5\x2f\xfd") + 4  # zstd's frame magic, then its descriptor byte
    return data[:i] + bytes([data[i] ^ 0x80]) + data[i + 1 :]


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "flip_payload": flip_last_byte,
    "flip_meta": flip_meta_byte,
    "truncate": lambda d: d[: len(d) // 2],
    "truncate_header": lambda d: d[:10],
    "empty": lambda d: b"",
    "garbage": lambda d: os.urandom(len(d)),
    "wrong_magic": lambda d: b"XXXX" + d[4:],
    "wrong_version": lambda d: d[:4] + bytes([99]) + d[5:],
    "appended": lambda d: d + b"\0",
    # numpy raises its own grammar's SyntaxError / ValueError for these
    "dtype_syntax": lambda d: d.replace(b"|u1", b",u1", 1),
    "dtype_value": lambda d: d.replace(b"|u1", b"|01", 1),
    # The zstd frame's descriptor asks for an 8-byte content size: terabytes, which zstd would
    # have allocated (MemoryError) before the checksum could tell.
    "zstd_content_size": flip_frame_descriptor,
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_corrupt_entry_is_a_counted_miss_and_removed(tmp_path: Path, how: str) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=MB)
    key = key_for("c")
    c.put_image(key, noise_image(1))
    path = c.path_for(key)
    path.write_bytes(CORRUPTIONS[how](path.read_bytes()))
    assert c.get_image(key) is None
    assert not path.exists()
    s = c.stats()
    assert (s.corrupt, s.misses, s.hits, s.entries, s.bytes) == (1, 1, 0, 0, 0)
    # The slot is usable again.
    c.put_image(key, noise_image(1))
    assert c.get_image(key) is not None


#: Entries whose checksum holds but whose contents no worker writes (a tampered file, a bug):
#: each raised its own error out of the lookup (the job failed as internal_error, and so did
#: every later job of that media, the file being kept), or was served as features.
WELL_FORMED_NONSENSE: dict[str, tuple[Any, dict[str, object]]] = {
    "float_pixels": (np.zeros((28, 28, 3), np.float32), {"original_size": [28, 28]}),
    "empty_dtype": (np.zeros((28, 28, 0), "V0"), {"original_size": [28, 28]}),
    "no_channels": (np.zeros((28, 28), np.uint8), {"original_size": [28, 28]}),
    "zero_size": (np.zeros((0, 28, 3), np.uint8), {"original_size": [28, 28]}),
    "huge_int": (np.zeros((28, 28, 3), np.uint8), {"original_size": [1e999, 28]}),
    "deep_meta": (np.zeros((28, 28, 3), np.uint8), {"original_size": [28, 28]}),
}


@pytest.mark.parametrize("how", sorted(WELL_FORMED_NONSENSE))
def test_an_entry_with_a_valid_checksum_but_nonsense_inside_is_a_miss(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zstandard

    from mmworker.cache import _KIND_IMAGE, _encode

    c = DiskFeatureCache(tmp_path, max_bytes=MB)
    key = key_for(how)
    array, meta = WELL_FORMED_NONSENSE[how]
    with monkeypatch.context() as m:
        if how == "deep_meta":  # nested deeper than json.loads recurses (RecursionError)
            m.setattr(json, "dumps", lambda *_, **__: '{"x":' * 100_000 + "1" + "}" * 100_000)
        blob = _encode(_KIND_IMAGE, array, meta, zstandard.ZstdCompressor())
    c.path_for(key).parent.mkdir(parents=True, exist_ok=True)
    c.path_for(key).write_bytes(blob)
    assert c.get_image(key) is None
    assert c.stats().corrupt == 1 and not c.path_for(key).exists()


def test_entry_of_the_wrong_kind_is_treated_as_corrupt(tmp_path: Path) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=MB)
    key = key_for("kind")
    c.put_video(key, sample_video())
    assert c.get_image(key) is None
    assert c.stats().corrupt == 1 and not c.path_for(key).exists()


def test_an_entry_under_another_keys_name_is_dropped_not_served(tmp_path: Path) -> None:
    """A whole, checksum-valid file at the wrong path (a restore that renamed files) is damage:
    served, it would caption one image with another's pixels."""
    c = DiskFeatureCache(tmp_path, max_bytes=MB)
    mine, other = key_for("mine"), key_for("other")
    c.put_image(mine, noise_image(1))
    c.path_for(other).parent.mkdir(parents=True, exist_ok=True)
    c.path_for(other).write_bytes(c.path_for(mine).read_bytes())
    fresh = DiskFeatureCache(tmp_path, max_bytes=MB)
    assert fresh.get_image(other) is None
    assert fresh.stats().corrupt == 1 and not fresh.path_for(other).exists()
    got = fresh.get_image(mine)
    assert got is not None and np.array_equal(got.pixels, noise_image(1).pixels)


def test_an_entry_from_before_keys_were_recorded_is_still_a_hit(tmp_path: Path) -> None:
    """Workers of the previous version share the directory during a rolling upgrade: their
    entries have no key in the meta, and are read, not dropped."""
    import zstandard

    from mmworker.cache import _KIND_IMAGE, _encode

    c = DiskFeatureCache(tmp_path, max_bytes=MB)
    key, image = key_for("old"), noise_image(2)
    meta = {"original_size": list(image.original_size)}
    blob = _encode(_KIND_IMAGE, image.pixels, meta, zstandard.ZstdCompressor())
    assert b'"key"' not in blob
    c.path_for(key).parent.mkdir(parents=True, exist_ok=True)
    c.path_for(key).write_bytes(blob)
    got = c.get_image(key)
    assert got is not None and got.original_size == image.original_size
    assert np.array_equal(got.pixels, image.pixels) and c.stats().corrupt == 0


def test_crashed_temp_file_is_cleaned_on_start_a_live_one_kept(tmp_path: Path) -> None:
    c1 = DiskFeatureCache(tmp_path, max_bytes=MB)
    key = key_for("t")
    c1.put_image(key, noise_image(1))
    # What a crash between write and rename leaves behind.
    tmp = c1.path_for(key).parent / f".{key_for('u')}.deadbeef.tmp"
    tmp.write_bytes(c1.path_for(key).read_bytes()[:100])
    # Another worker sharing the directory, mid-write: its temp file is recent.
    live = c1.path_for(key).parent / f".{key_for('v')}.cafe.tmp"
    live.write_bytes(b"partial")
    stale = time.time() - STALE_TMP_S - 60
    os.utime(tmp, (stale, stale))
    c2 = DiskFeatureCache(tmp_path, max_bytes=MB)
    assert not tmp.exists()
    assert live.exists()
    assert c2.stats().entries == 1
    assert c2.stats().bytes == entry_size(c2, key)
    assert c2.get_image(key_for("u")) is None


def test_half_written_file_at_final_name_is_detected_after_restart(tmp_path: Path) -> None:
    c1 = DiskFeatureCache(tmp_path, max_bytes=MB)
    key = key_for("half")
    c1.put_image(key, noise_image(1))
    path = c1.path_for(key)
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 50])
    c2 = DiskFeatureCache(tmp_path, max_bytes=MB)
    assert c2.stats().entries == 1  # startup does not read entries, only lists them
    assert c2.get_image(key) is None
    assert c2.stats().corrupt == 1 and c2.stats().entries == 0
    assert not path.exists()


def test_failed_write_is_counted_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = DiskFeatureCache(tmp_path, max_bytes=MB)

    def broken_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    c.put_image(key_for("f"), noise_image(1))
    s = c.stats()
    assert (s.io_errors, s.writes, s.entries, s.bytes) == (1, 0, 0, 0)
    assert files_in(tmp_path) == []  # the temp file was removed too


def test_unrelated_files_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.txt").write_text("keep me")
    (tmp_path / "README").write_text("keep me too")
    c = DiskFeatureCache(tmp_path, max_bytes=MB)
    assert c.stats().entries == 0
    assert (tmp_path / "ab" / "notes.txt").exists() and (tmp_path / "README").exists()


# -- disabled cache ----------------------------------------------------------------------------


def test_null_cache_always_misses() -> None:
    c: FeatureCache = NullFeatureCache()
    key = key_for("n")
    c.put_image(key, noise_image(1))
    c.put_video(key, sample_video())
    assert c.get_image(key) is None
    assert c.get_video(key) is None
    s = c.stats()
    assert (s.hits, s.misses, s.writes, s.entries, s.bytes) == (0, 2, 0, 0, 0)


# -- concurrency -------------------------------------------------------------------------------


def test_concurrent_puts_and_gets_keep_index_consistent(tmp_path: Path) -> None:
    images = {key_for(f"k{i}"): noise_image(i, size=28) for i in range(24)}
    probe = DiskFeatureCache(tmp_path / "probe", max_bytes=MB)
    probe.put_image(key_for("k0"), images[key_for("k0")])
    size = entry_size(probe, key_for("k0"))
    c = DiskFeatureCache(tmp_path / "c", max_bytes=10 * size)  # forces constant eviction
    keys = list(images)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            k = keys[int(rng.integers(len(keys)))]
            if rng.random() < 0.5:
                c.put_image(k, images[k])
            else:
                got = c.get_image(k)
                if got is not None and not np.array_equal(got.pixels, images[k].pixels):
                    errors.append(k)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = c.stats()
    on_disk = files_in(tmp_path / "c")
    assert all(p.suffix == ".mmf" for p in on_disk)
    assert s.entries == len(on_disk)
    assert s.bytes == sum(p.stat().st_size for p in on_disk)
    assert s.bytes <= c.max_bytes
    assert s.corrupt == 0 and s.hits > 0 and s.evictions > 0


def test_prune_lru_files_drops_oldest_first_and_keeps_recent(tmp_path: Path) -> None:
    from mmworker.cache import prune_lru_files

    now = time.time()
    ages = {"old": 3000, "mid": 2000, "new": 1000, "hot": 10}
    for name, age in ages.items():
        f = tmp_path / name / "encoder_cache.safetensors"
        f.parent.mkdir()
        f.write_bytes(b"x" * 1000)
        os.utime(f, (now - age, now - age))
    assert prune_lru_files(tmp_path, max_bytes=2500, keep_recent_s=300) == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hot", "new"]  # emptied dirs removed
    # Over budget, but what is left was used within keep_recent_s: a reader may be about to load it.
    assert prune_lru_files(tmp_path, max_bytes=0, keep_recent_s=500) == 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hot"]


def test_a_cache_directory_that_cannot_be_made_is_a_one_line_configuration_error(
    tmp_path: Path,
) -> None:
    """It came out as a traceback from the middle of start-up."""
    from mmworker.app import make_cache
    from mmworker.config import load_config
    from mmworker.errors import ConfigError

    (tmp_path / "a-file").write_text("")
    cfg = load_config(cache={"directory": str(tmp_path / "a-file" / "features")})
    with pytest.raises(ConfigError, match=r"cannot be used .* cache\.enabled = false"):
        make_cache(cfg)
