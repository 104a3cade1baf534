"""Build (once, cached on disk) and load the native CPU kernels of csrc/.

The library is compiled with the system C++ compiler against this torch's headers, for
this CPU (-march=native; with PAGEDLLM_CPU_ISA=avx2, less AVX-512), into
`cache_root()/kernels/<key>.so`; the key hashes the sources, the torch version, the flags
and the CPU's feature flags, so a cached build is reused only where it was made for.

If there is no compiler or the build fails, PAGEDLLM_CPU_KERNELS decides: "auto" (the
default) logs a warning saying what is lost and the torch paths run instead; "required"
(the test suite's default) raises KernelBuildError; "off" never builds.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pagedllm.config import cache_root, env_cpu_isa, env_cpu_kernels_mode
from pagedllm.kernels.cpu.features import cpu_flags_line, native_cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("cpu_attention.cpp", "cpu_ops.cpp", "cpu_decoder.cpp",
                                     "cpu_gemm.cpp", "cpu_quant.cpp",
                                     "cpu_quant_rows.cpp", "cpu_lora.cpp",
                                     "cpu_logprobs.cpp")]
HEADERS = [CSRC / name for name in ("simd.h", "fp8.h", "attention_common.h",
                                     "attention_avx512.h", "attention_amx.h",
                                     "attention_generic.h", "ops.h", "quant_avx2.h",
                                     "quant_avx512.h", "quant_amx.h", "quant_amx_bf16.h",
                                     "amx.h", "gemm_amx.h", "quant_layout.h",
                                     "work_split.h", "torch_headers.h")]
PCH_HEADER = CSRC / "torch_headers.h"
# -ffp-contract=off: no fused multiply-adds the source does not spell out, so float32
# element-wise ops round like torch's. -Wall, less GCC 12's (-Wmaybe-)uninitialized: they
# fire only inside its own AVX-512 intrinsics, whose pass-through operand is
# _mm512_undefined_*() by design (GCC bug 105593; every one of the ~900 is that), and
# less -Wstringop-overflow, which GCC 12 raises only inside torch's own headers (the
# refcount atomics of c10::intrusive_ptr, inlined into IValue's constructor where
# cpu_decoder.cpp calls oneDNN's linear through the dispatcher).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-ffp-contract=off",
         "-shared", "-fPIC", "-std=c++20", "-Wall", "-Wno-maybe-uninitialized",
         "-Wno-uninitialized", "-Wno-stringop-overflow"]


class KernelBuildError(RuntimeError):
    """The native CPU kernels could not be built or loaded."""


def flags() -> list[str]:
    """FLAGS, less AVX-512 (every extension of it) under PAGEDLLM_CPU_ISA=avx2 on a CPU
    that has it. On one without, -march=native has none already: the same flags, so the
    same cached library (a second, identical build took ~2.5 min on 2 cores)."""
    drop = env_cpu_isa() == "avx2" and "avx512f" in native_cpu_flags()
    return FLAGS + (["-mno-avx512f"] if drop else [])


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile, link) flags for building against this torch."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    return [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes], [*libs, *rpath, "-lc10",
                                                             "-ltorch_cpu"]


def _compile_command(compiler: str, source: Path, output: Path,
                     pch: Path | None = None) -> list[str]:
    """The command compiling `source`; with `pch` (a header next to its compiled .gch),
    that header comes first: the compiler loads the .gch instead of parsing it again, or
    parses it when it cannot use the .gch (-Winvalid-pch says so)."""
    first = ["-include", str(pch), "-Winvalid-pch"] if pch is not None else []
    return [compiler, *flags(), *_torch_flags()[0], *first, "-c", str(source), "-o",
            str(output)]


def _precompile_header(compiler: str, tmp: Path) -> Path | None:
    """PCH_HEADER compiled into `tmp` (with the sources' flags: a .gch is only used by
    compiles with the same ones), or None where the compiler cannot (the sources then
    parse the headers themselves, with the same result).

    -w: compiled on its own, the header instantiates templates of torch's that no source
    uses, and some of them warn (-Wsign-compare in c10's overflow checks); warnings do not
    change the .gch, and the sources' own compiles still warn about their own code.
    """
    header = tmp / PCH_HEADER.name
    shutil.copyfile(PCH_HEADER, header)
    command = [compiler, *flags(), *_torch_flags()[0], "-w", "-x", "c++-header",
               str(header), "-o", f"{header}.gch"]
    try:
        _run(command)
    except KernelBuildError as e:
        logger.info("building the CPU kernels without a precompiled header: %s", e)
        return None
    return header


def _link_command(compiler: str, objects: list[Path], output: str) -> list[str]:
    return [compiler, *flags(), *map(str, objects), *_torch_flags()[1], "-o", output]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        raise KernelBuildError(f"cannot run {command[0]}: {e}") from e
    if done.returncode != 0:
        raise KernelBuildError(f"{command[0]} failed (exit {done.returncode}):\n"
                               f"{done.stderr[-3000:]}")
    return done


def library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    sources = [src.read_bytes() for src in (*SOURCES, *HEADERS)]
    for part in (*sources, torch.__version__.encode(), " ".join(flags()).encode(),
                 compiler.encode(), cpu_flags_line().encode()):
        key.update(part)
    return cache_root() / "kernels" / f"pagedllm_cpu-{key.hexdigest()[:16]}.so"


def build_library(compiler: str, sources: list[Path], path: Path) -> None:
    """Compile `sources` into `path` (atomically); KernelBuildError with the compiler's
    output when it fails. Warnings of a successful build are logged."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time across processes; the others wait and reuse its output.
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        logger.info("building CPU kernels (once per machine) -> %s", path)
        # Each source compiles on its own, all at once up to the core count, then one
        # link: the build takes about as long as its slowest file (cpu_quant.cpp) where
        # there are enough cores, instead of the sum of all (2 cores, Zen 3: 189 ->
        # 95-103 s; the sources compile separately either way: the same machine code).
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            # One parse of torch's headers for all sources (only pays off for two or more).
            pch = _precompile_header(compiler, Path(tmp)) if len(sources) > 1 else None
            objects = [Path(tmp) / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
            workers = max(1, min(len(sources), len(os.sched_getaffinity(0))))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                compiled = list(pool.map(_run, [_compile_command(compiler, src, obj, pch)
                                                for src, obj in zip(sources, objects)]))
            output = str(Path(tmp) / "lib.so")
            linked = _run(_link_command(compiler, objects, output))
            warnings = "".join(d.stderr for d in (*compiled, linked) if "warning:" in d.stderr)
            if warnings:
                logger.warning("CPU kernels built with warnings:\n%s", warnings[-3000:])
            os.replace(output, path)  # atomic: readers never see a half-written library


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> bool:
    """Build (once) and load the kernels; True when `torch.ops.pagedllm_cpu` is usable.

    False (with a warning) when they cannot be had and PAGEDLLM_CPU_KERNELS is "auto";
    KernelBuildError when it is "required".
    """
    mode = env_cpu_kernels_mode()
    if mode == "off":
        return False
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return _unavailable(mode, "no C++ compiler (g++ or c++) on PATH")
    try:
        path = library_path(compiler)
        if not path.exists():
            build_library(compiler, SOURCES, path)
        if not _is_loaded():
            torch.ops.load_library(str(path))
            _register_fakes()
    except (OSError, KernelBuildError) as e:
        return _unavailable(mode, str(e))
    return True


def _is_loaded() -> bool:
    """True once this process registered the ops (a reload would register them twice)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("pagedllm_cpu::argmax", "CPU")
    except RuntimeError:  # "operator ... does not exist"
        return False


def _unavailable(mode: str, reason: str) -> bool:
    if mode == "required":
        raise KernelBuildError(
            f"the native CPU kernels are required (PAGEDLLM_CPU_KERNELS=required) but "
            f"unavailable: {reason}")
    logger.warning("native CPU kernels unavailable, running the torch paths instead "
                   "(CPU attention, bf16 GEMM, norms and the fused decoder stack several "
                   "times slower): %s", reason[-2000:])
    return False


def _register_fakes() -> None:
    """Shape-only versions of the ops, so torch.compile can trace through them."""
    for name in ("paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul",
                 "gemm_bf16", "gemm_f32", "gemm_quant", "quant_rows", "argmax",
                 "sample_draw"):
        torch.library.register_fake(f"pagedllm_cpu::{name}")(lambda *args, **kwargs: None)
