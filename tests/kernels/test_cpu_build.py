"""The native CPU kernel build fails loudly: a broken source or compiler raises
KernelBuildError with the compiler's message; "auto" falls back with a warning, "required"
raises, and the suite itself runs with "required" (tests/conftest.py)."""

from __future__ import annotations

import logging
import os

import pytest

from pagedllm.kernels.cpu import build, features


def test_the_suite_requires_the_native_build():
    assert os.environ["PAGEDLLM_CPU_KERNELS"] in ("required", "auto")
    if os.environ["PAGEDLLM_CPU_KERNELS"] == "required":
        assert build.load_cpu_kernels() is True


def test_the_cache_key_covers_every_source():
    """The cached library's key hashes SOURCES and HEADERS: a file of csrc/ in neither
    would not rebuild the library when it changes."""
    files = {p.name for p in build.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert files == {p.name for p in (*build.SOURCES, *build.HEADERS)}


@pytest.mark.parametrize("cpu_has_avx512", [True, False])
def test_avx2_isa_drops_avx512_only_where_the_cpu_has_it(monkeypatch, cpu_has_avx512):
    """PAGEDLLM_CPU_ISA=avx2 adds -mno-avx512f on an AVX-512 CPU; on one without,
    -march=native has no AVX-512 to drop, so the flags (and the cached library's key) are
    the native build's and that library is reused instead of built again."""
    line = "flags\t\t: fpu sse2 avx2 fma f16c" + (" avx512f avx512bw" if cpu_has_avx512 else "")
    monkeypatch.setattr(features, "cpu_flags_line", lambda: line)
    monkeypatch.delenv("PAGEDLLM_CPU_ISA", raising=False)
    native = build.flags()
    assert "-mno-avx512f" not in native
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "avx2")
    assert build.flags() == (native + ["-mno-avx512f"] if cpu_has_avx512 else native)


def test_broken_source_raises_with_the_compiler_message(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("int main() { return undefined_name; }\n")
    with pytest.raises(build.KernelBuildError, match="undefined_name"):
        build.build_library("g++", [source], tmp_path / "out.so")
    assert not (tmp_path / "out.so").exists()


def test_missing_compiler_raises(tmp_path):
    with pytest.raises(build.KernelBuildError, match="cannot run"):
        build.build_library(str(tmp_path / "no-such-g++"), build.SOURCES, tmp_path / "o.so")


@pytest.mark.parametrize("mode", ["auto", "required", "off"])
def test_failed_build_by_mode(monkeypatch, tmp_path, caplog, mode):
    """A compiler that fails: auto -> False and a warning naming the loss, required ->
    KernelBuildError, off -> False without trying."""
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\necho 'fatal: simulated compiler failure' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", mode)
    build.load_cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=build.__name__):
            if mode == "required":
                with pytest.raises(build.KernelBuildError, match="simulated compiler failure"):
                    build.load_cpu_kernels()
            else:
                assert build.load_cpu_kernels() is False
        if mode == "auto":
            assert "simulated compiler failure" in caplog.text
            assert "torch paths" in caplog.text
        if mode == "off":
            assert not (tmp_path / "cache").exists()
    finally:
        build.load_cpu_kernels.cache_clear()



def _two_sources(tmp_path, own_definition: str = ""):
    """Two sources calling `from_header`, which only the forced header declares (unless
    `own_definition` gives each its own)."""
    sources = []
    for name in ("a", "b"):
        src = tmp_path / f"{name}.cpp"
        src.write_text(f"{own_definition}int {name}() {{ return from_header(); }}\n")
        sources.append(src)
    return sources


def test_sources_compile_against_the_precompiled_header(tmp_path, monkeypatch, caplog):
    """Every source is compiled with the header forced in first, from its .gch: the
    header's text is replaced by an #error once the .gch is built, so a compile that
    parsed the text instead (a .gch made with other flags) would fail."""
    header = tmp_path / "pch.h"
    header.write_text("#pragma once\ninline int from_header() { return 7; }\n")
    monkeypatch.setattr(build, "PCH_HEADER", header)
    precompile = build._precompile_header

    def precompile_then_hide_the_text(compiler, tmp):
        copied = precompile(compiler, tmp)
        assert copied is not None and copied.with_name(copied.name + ".gch").is_file()
        copied.write_text('#error "parsed the text, not the precompiled header"\n')
        return copied

    monkeypatch.setattr(build, "_precompile_header", precompile_then_hide_the_text)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        build.build_library("g++", _two_sources(tmp_path), tmp_path / "out.so")
    assert (tmp_path / "out.so").is_file()
    assert "warning" not in caplog.text  # -Winvalid-pch: a .gch found but unusable


def test_a_header_that_cannot_be_precompiled_is_left_out(tmp_path, monkeypatch):
    """Where the header does not precompile, the sources compile as they are (the real
    ones include torch's headers themselves); forced in, this header would fail them."""
    header = tmp_path / "pch.h"
    header.write_text("this is not C++\n")
    monkeypatch.setattr(build, "PCH_HEADER", header)
    own = "static int from_header() { return 7; }\n"
    build.build_library("g++", _two_sources(tmp_path, own), tmp_path / "out.so")
    assert (tmp_path / "out.so").is_file()
