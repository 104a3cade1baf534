"""Native CPU kernels (csrc/cpu_attention.cpp), built on first use and cached on disk.

The library is compiled with the system C++ compiler against this torch's headers, for
this CPU (-march=native), into `cache_root()/kernels/<key>.so`; the key hashes the source,
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

_SOURCE = Path(__file__).parent / "csrc" / "cpu_attention.cpp"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-strict-aliasing", "-shared", "-fPIC",
          "-std=c++20", "-w"]


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
    return [compiler, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(_SOURCE),
            *libs, *rpath, "-lc10", "-ltorch_cpu", "-o", output]


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), " ".join(_FLAGS).encode(),
                 compiler.encode(), _cpu_flags().encode()):
        key.update(part)
    return cache_root() / "kernels" / f"cpu_attention-{key.hexdigest()[:16]}.so"


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time across processes; the others wait and reuse its output.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return
        logger.info("building CPU attention kernels (once per machine) -> %s", path)
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
        logger.warning("no C++ compiler found: CPU attention uses the slower torch path")
        return False
    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
        torch.ops.load_library(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("building CPU attention kernels failed; using the torch path:\n%s",
                       detail[-2000:])
        return False
    return True


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
    torch.ops.pagedllm_cpu.paged_attention(
        out, query, key, value, kv_cache, slot_mapping, block_table, seq_lens,
        query_start_loc, scale, sliding_window or 0, q_tile)
