"""llama.cpp's tokenizer-only GGUF files (`ggml-vocab-*.gguf`) and its reference tokenizations,
taken from the `llama-cpp-python` source distribution on PyPI.

The sdist vendors llama.cpp, whose `models/` directory holds vocabulary-only GGUFs of real
tokenizers (gpt-2, qwen2, phi-3, llama-bpe, llama-spm, ...) and, for most of them, test
inputs (`.gguf.inp`: texts separated by a marker line) with the token ids llama.cpp and the
original HF tokenizer produce (`.gguf.out`: one line of ids per text, no special tokens).

The files are downloaded once (`pip download`, about 75 MiB) into a cache outside the
repository, `$PAGEDLLM_TEST_DATA` or `~/.cache/pagedllm-test-data`, and only the vocab files
are kept. Without network on the first run the tests fail with a message saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""Pinned: the set of vocab files and their expected ids change between llama.cpp versions."""
_MEMBER_DIR = "vendor/llama.cpp/models/"
_MARKER = ".complete"
TEST_SEPARATOR = "\n__ggml_vocab_test__\n"
"""Separator of the texts in a `.gguf.inp` file (llama.cpp's tests/test-tokenizer-0.cpp)."""


class VocabDownloadError(RuntimeError):
    """The sdist could not be fetched or unpacked."""


def data_root() -> Path:
    return Path(os.environ.get("PAGEDLLM_TEST_DATA")
                or Path.home() / ".cache" / "pagedllm-test-data")


def vocab_dir() -> Path:
    """Directory holding the `ggml-vocab-*` files, downloading them on first use."""
    target = data_root() / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}-vocab"
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".tmp-vocab-") as tmp:
        sdist = _download_sdist(Path(tmp))
        staging = Path(tmp) / "vocab"
        _extract_vocab_files(sdist, staging)
        (staging / _MARKER).write_text(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}\n")
        try:
            os.replace(staging, target)
        except OSError:  # a concurrent run published first (or a stale partial dir)
            if not (target / _MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
    return target


def _download_sdist(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--timeout", "60", f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VocabDownloadError(f"`{' '.join(cmd)}` did not finish: {e}") from e
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr).strip()[-2000:]
        raise VocabDownloadError(
            f"could not download the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist from "
            f"PyPI (needs network on the first run; the files are then cached under "
            f"{data_root()}, or set PAGEDLLM_TEST_DATA to a directory that has them).\n"
            f"command: {' '.join(cmd)}\nexit code {proc.returncode}; output:\n{tail}")
    return found[0]


def _extract_vocab_files(sdist: Path, dest: Path) -> None:
    """Copy `vendor/llama.cpp/models/ggml-vocab-*` (regular files only) into `dest`."""
    dest.mkdir()
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                _, _, name = member.name.partition("/")  # drop the top-level directory
                if not (member.isfile() and name.startswith(_MEMBER_DIR)):
                    continue
                base = name[len(_MEMBER_DIR):]
                if "/" in base or not base.startswith("ggml-vocab-"):
                    continue
                src = tar.extractfile(member)
                assert src is not None
                with src, open(dest / base, "wb") as out:
                    shutil.copyfileobj(src, out)
    except (OSError, tarfile.TarError) as e:
        raise VocabDownloadError(f"cannot unpack {sdist}: {e}") from e
    if not any(dest.glob("ggml-vocab-*.gguf")):
        raise VocabDownloadError(f"{sdist} holds no {_MEMBER_DIR}ggml-vocab-*.gguf files")


def reference_tests(vocab_file: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's `(text, expected ids)` pairs for a vocab file, [] when it has none.

    Parsed as llama.cpp's test-tokenizer-0 does: the `.inp` file split on the separator (a
    trailing separator ends the last text), one whitespace-separated id line per text.
    """
    inp = vocab_file.with_name(vocab_file.name + ".inp")
    out = vocab_file.with_name(vocab_file.name + ".out")
    if not (inp.is_file() and out.is_file()):
        return []
    raw = inp.read_bytes().decode("utf-8")
    texts = raw.split(TEST_SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    ids = [[int(x) for x in line.split()] for line in out.read_text().splitlines()]
    if len(texts) != len(ids):
        raise ValueError(f"{inp.name}: {len(texts)} texts but {len(ids)} id lines")
    return list(zip(texts, ids))
