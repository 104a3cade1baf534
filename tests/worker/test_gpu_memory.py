"""KV cache sizing on CUDA by memory profiling (gpu_memory_utilization).

CPU: the arithmetic (`blocks_from_profile`), the dummy step (`profile_batch`,
`ModelRunner.profile_run` run without measuring), the wiring of `cuda_num_blocks` over
stubbed CUDA statistics, and the options. CUDA (`@pytest.mark.cuda`): an engine stays
within utilization x total, more utilization gives more blocks, too little fails clearly.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from pagedllm.config import CacheConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker import memory
from pagedllm.worker.memory import GiB, blocks_from_profile, profile_batch
from tests.utils import save_tiny_model, tiny_llama_config

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), tiny_llama_config())


# --- blocks_from_profile ---------------------------------------------------------------

def test_blocks_from_profile_is_what_the_budget_leaves():
    # 80 GiB x 0.9 = 72 GiB - 16 weights - 2 activations - 1 non-torch = 53 GiB.
    blocks = blocks_from_profile(80 * GiB, 0.9, 16 * GiB, 2 * GiB, 1 * GiB, 2 * MiB,
                                 cap_blocks=10**9)
    assert blocks == 53 * 512


def test_blocks_from_profile_is_capped():
    assert blocks_from_profile(80 * GiB, 0.9, 16 * GiB, 2 * GiB, 1 * GiB, 2 * MiB,
                               cap_blocks=4097) == 4097


def test_blocks_from_profile_needs_two_blocks():
    # Exactly two blocks left (the null block and one usable): enough.
    assert blocks_from_profile(10 * GiB, 0.5, 4 * GiB, 1 * GiB - 2 * MiB, 0, MiB, 100) == 2
    with pytest.raises(ValueError):
        blocks_from_profile(10 * GiB, 0.5, 4 * GiB, 1 * GiB - MiB, 0, MiB, 100)


def test_blocks_from_profile_error_names_the_figures_and_the_remedies():
    with pytest.raises(ValueError) as e:
        blocks_from_profile(80 * GiB, 0.25, 16 * GiB, 3.5 * GiB, 1.25 * GiB, 2 * MiB,
                            cap_blocks=10**9)
    msg = str(e.value)
    for figure in ("gpu_memory_utilization=0.25", "80.00 GiB", "20.00 GiB", "16.00 GiB",
                   "3.50 GiB", "1.25 GiB", "-0.75 GiB"):
        assert figure in msg, (figure, msg)
    for remedy in ("Raise gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs",
                   "smaller model"):
        assert remedy in msg, (remedy, msg)


# --- cuda_num_blocks over stubbed CUDA statistics ----------------------------------------

def test_cuda_num_blocks_measures_weights_before_and_non_torch_after(monkeypatch):
    """Weights: torch's reserved bytes before the profile; non-torch: used - reserved
    after it, once the profile's cached blocks are released."""
    # What torch reserves, and what empty_cache leaves of it (the live allocations).
    state = {"reserved": 10 * GiB, "live": 10 * GiB}

    def profile() -> int:
        # A 0.5 GiB workspace (cuBLAS) outlives the step and is part of its peak; the
        # rest of the 14 GiB held at the end is cache that empty_cache gives back.
        state["reserved"], state["live"] = 14 * GiB, 10.5 * GiB
        return 3 * GiB

    def empty_cache() -> None:
        state["reserved"] = state["live"]

    # used = total - free = 12 GiB: 10.5 reserved + 1.5 outside torch.
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: state["reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (68 * GiB, 80 * GiB))
    cache = CacheConfig(gpu_memory_utilization=0.5)
    # 40 GiB - 10 weights - 3 activations - 1.5 non-torch = 25.5 GiB of 1 MiB blocks.
    assert memory.cuda_num_blocks(cache, MiB, 10**9, profile) == int(25.5 * 1024)


# --- the dummy step ----------------------------------------------------------------------

@pytest.mark.parametrize("tokens,seqs,max_len,block", [
    (2048, 256, 8192, 16),  # 256 sequences of 8 tokens
    (100, 8, 256, 16),  # uneven: 4 of 13, 4 of 12
    (5, 256, 64, 4),  # fewer tokens than sequences: one token each
    (2048, 1, 256, 16),  # one sequence, clipped to max_model_len
])
def test_profile_batch_is_a_valid_prefill_step(tokens, seqs, max_len, block):
    b = profile_batch(tokens, seqs, max_len, block)
    num_seqs = min(seqs, tokens)
    assert len(b.seq_lens) == num_seqs
    assert b.seq_lens.sum() == len(b.positions) == min(tokens, num_seqs * max_len)
    assert b.seq_lens.max() - b.seq_lens.min() <= 1 and b.seq_lens.max() <= max_len
    assert (np.diff(b.query_start_loc) == b.seq_lens).all()
    # Every token its own slot, none in the null block, all within the cache.
    assert len(set(b.slot_mapping.tolist())) == len(b.slot_mapping)
    assert b.slot_mapping.min() >= block and b.slot_mapping.max() < b.num_blocks * block
    assert b.block_table.min() >= 1 and b.block_table.max() < b.num_blocks
    for i in range(num_seqs):  # positions restart at 0 in each sequence
        start, end = b.query_start_loc[i], b.query_start_loc[i + 1]
        assert (b.positions[start:end] == np.arange(end - start)).all()


def test_profile_run_on_cpu_leaves_the_engine_as_it_was(tiny_path):
    """Off CUDA nothing is measured (0), but the whole dummy step runs, and the
    engine's own cache is bound again afterwards (same greedy tokens)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, device="cpu",
              max_num_seqs=8, max_num_batched_tokens=100, num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    # 40 tokens: the second run reads the first one's two full blocks from the cache.
    prompt = [{"prompt_token_ids": [(7 * i + 3) % 256 for i in range(40)]}]
    before = llm.generate(prompt, params)[0]
    runner = llm.llm_engine.engine_core.executor.runner
    layers = memory.attention_layers(runner.model)
    caches = [layer.kv_cache for layer in layers]
    assert runner.profile_run() == 0
    assert all(layer.kv_cache is cache for layer, cache in zip(layers, caches))
    after = llm.generate(prompt, params)[0]
    assert after.num_cached_tokens == 32
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


# --- options -----------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -0.5, 1.01])
def test_gpu_memory_utilization_is_validated(tiny_path, value):
    with pytest.raises(ValueError, match=f"gpu_memory_utilization.*{value}"):
        CacheConfig(gpu_memory_utilization=value)
    with pytest.raises(ValueError, match=f"gpu_memory_utilization.*{value}"):
        EngineArgs(model=str(tiny_path), device="cpu",
                   gpu_memory_utilization=value).create_engine_config()


def test_options_reach_the_configs(tiny_path):
    config = EngineArgs(model=str(tiny_path), device="cpu", gpu_memory_utilization=1.0,
                        enforce_eager=True).create_engine_config()
    assert config.cache.gpu_memory_utilization == 1.0
    assert config.device.enforce_eager is True
    default = EngineArgs(model=str(tiny_path), device="cpu").create_engine_config()
    assert default.cache.gpu_memory_utilization == 0.9
    assert default.device.enforce_eager is False


def test_cli_flags(capsys):
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = capsys.readouterr().out
    assert "--gpu-memory-utilization" in help_text and "--enforce-eager" in help_text
    args = engine_args_from(build_parser().parse_args(
        ["generate", "--gpu-memory-utilization", "0.5", "--enforce-eager"]))
    assert args.gpu_memory_utilization == 0.5 and args.enforce_eager is True


# --- CUDA ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_path(tmp_path_factory):
    """A small random Llama with 256 KiB KV blocks (8 layers x 8 KV heads x 64 x bf16):
    with max_num_seqs=1024 at max_model_len 8192 the useful-block cap is 128 GiB, so
    the memory budget, not the cap, decides on an H100 or H200 (42 MB of weights)."""
    return save_tiny_model(tmp_path_factory.mktemp("wide_llama"), tiny_llama_config(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=8192), dtype=torch.bfloat16)


def _cuda_llm(path, utilization: float, **kw):
    from pagedllm import LLM

    return LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, device="cuda",
               gpu_memory_utilization=utilization, max_num_seqs=1024, **kw)


def _release(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_engine_stays_within_utilization(wide_path, enforce_eager):
    from pagedllm import SamplingParams

    llm = _cuda_llm(wide_path, 0.3, enforce_eager=enforce_eager)
    try:
        # A step at the token budget must run in what the profile left.
        prompts = [{"prompt_token_ids": [1 + i % 250 for i in range(500)]} for _ in range(8)]
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0))
        free, total = torch.cuda.mem_get_info()
        # torch's reserved memory + everything outside torch (context, other processes).
        used = total - free
        assert used <= (0.3 + 0.02) * total, (used / GiB, total / GiB)
        assert llm.llm_engine.engine_core.num_blocks < 1024 * 512 + 1  # not the cap
    finally:
        _release(llm)


@pytest.mark.cuda
@needs_cuda
def test_more_utilization_gives_more_blocks(wide_path):
    counts = []
    for utilization in (0.2, 0.4):
        llm = _cuda_llm(wide_path, utilization, enforce_eager=True)
        counts.append(llm.llm_engine.engine_core.num_blocks)
        _release(llm)
        del llm  # before the next engine profiles: its cache must be gone
    per_block = 8 * 2 * 16 * 8 * 64 * 2  # layers x K/V x tokens x heads x dim x bf16
    total = torch.cuda.mem_get_info()[1]
    # 0.2 x total more memory, all of it KV blocks (the rest is measured the same).
    extra = (counts[1] - counts[0]) * per_block
    assert abs(extra - 0.2 * total) <= 0.02 * total, (counts, extra / GiB)


@pytest.mark.cuda
@needs_cuda
def test_too_small_utilization_says_what_to_change(wide_path):
    with pytest.raises(ValueError, match="no memory left for the KV cache") as e:
        _cuda_llm(wide_path, 0.0001)
    assert "Raise gpu_memory_utilization" in str(e.value)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.cuda
@needs_cuda
def test_weights_that_do_not_fit_name_their_size(wide_path):
    from pagedllm.errors import ModelLoadError

    # A few KiB for this process: the first parameter's allocation fails.
    torch.cuda.set_per_process_memory_fraction(1e-7)
    try:
        with pytest.raises(ModelLoadError, match=r"weights \(\d+\.\d\d GiB in bfloat16\) "
                                                 r"do not fit.*GiB free of"):
            _cuda_llm(wide_path, 0.3)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()
