"""Native CPU kernels (csrc/: paged attention and the fused element-wise ops of decoder
layers), built on first use and cached on disk.

The library is compiled with the system C++ compiler against this torch's headers, for
this CPU (-march=native), into `cache_root()/kernels/<key>.so`; the key hashes the sources,
the torch version, the flags and the CPU's feature flags, so a cached build is reused only
where it was made for. Without a compiler (or if the build fails) `load_cpu_kernels()`
returns False and the `cpu` attention backend falls back to its pure-torch path.
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
from pathlib import Path

import torch

from pagedllm.config import cache_root

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("cpu_attention.cpp", "cpu_ops.cpp", "cpu_decoder.cpp",
                                       "cpu_gemm.cpp")]
_HEADERS = [_CSRC / name for name in ("simd.h", "attention_common.h", "attention_avx512.h",
                                       "ops.h")]
# -ffp-contract=off: no fused multiply-adds the source does not spell out, so float32
# element-wise ops round like torch's.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-ffp-contract=off",
          "-shared", "-fPIC", "-std=c++20", "-w"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build_command(compiler: str, output: str) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    return [compiler, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
            *map(str, _SOURCES), *libs, *rpath, "-lc10", "-ltorch_cpu", "-o", output]


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    sources = [src.read_bytes() for src in (*_SOURCES, *_HEADERS)]
    for part in (*sources, torch.__version__.encode(), " ".join(_FLAGS).encode(),
                 compiler.encode(), _cpu_flags().encode()):
        key.update(part)
    return cache_root() / "kernels" / f"pagedllm_cpu-{key.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time across processes; the others wait and reuse its output.
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        logger.info("building CPU kernels (once per machine) -> %s", path)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            subprocess.run(_build_command(compiler, tmp), check=True, capture_output=True,
                           text=True)
            os.replace(tmp, path)  # atomic: readers never see a half-written library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def load_cpu_kernels() -> bool:
    """Build (once) and load the kernels; True when `torch.ops.pagedllm_cpu` is usable."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("no C++ compiler found: CPU attention and layers use the slower "
                       "torch paths")
        return False
    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
        torch.ops.load_library(str(path))
        _register_fakes()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("building CPU kernels failed; using the torch paths:\n%s",
                       detail[-2000:])
        return False
    return True


def cpu_ops_available(x: torch.Tensor) -> bool:
    """True when `x` is on the CPU and the native ops are loaded (fused layer paths).

    False while torch.compile traces: inductor fuses the torch versions itself.
    """
    if torch.compiler.is_compiling():
        return False
    return x.device.type == "cpu" and load_cpu_kernels()


def _register_fakes() -> None:
    """Shape-only versions of the ops, so torch.compile can trace through them."""
    for name in ("paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul",
                 "gemm_bf16", "argmax"):
        torch.library.register_fake(f"pagedllm_cpu::{name}")(lambda *args, **kwargs: None)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                    value: torch.Tensor | None, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None, q_tile: int = 16) -> None:
    """Write key/value [T, KVH, D] (if given) at slot_mapping, then attend query [T, H, D]
    over each request's paged context into out [T, H, D].

    block_table [R, max_blocks], seq_lens [R] and query_start_loc [R + 1] are int32;
    slot_mapping [T] int64. Query tokens are tiled by `q_tile` per work item.
    """
    torch.ops.pagedllm_cpu.paged_attention.default(
        out, query, key, value, kv_cache, slot_mapping, block_table, seq_lens,
        query_start_loc, scale, sliding_window or 0, q_tile)
