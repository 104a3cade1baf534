"""core/ must stay pure Python: importing all of it must not pull in torch."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pagedllm.core

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_core_imports_without_torch() -> None:
    modules = sorted(f"pagedllm.core.{m.name}"
                     for m in pkgutil.iter_modules(pagedllm.core.__path__))
    assert {"pagedllm.core.scheduler", "pagedllm.core.kv_cache_manager",
            "pagedllm.core.block_pool", "pagedllm.core.block_hash"} <= set(modules)
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "bad = sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.'))\n"
            "assert not bad, bad\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
