"""HF checkpoint directories: every on-disk variant streams the same named tensors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm.errors import ModelLoadError
from pagedllm.loader import detect_format, iter_weights, load_tokenizer
from pagedllm.loader.safetensors import convert, find_weight_files


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[LlamaConfig, LlamaForCausalLM]:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      tie_word_embeddings=False)
    return cfg, LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tiny_llama[1].state_dict().items()}


def _save_bin_sharded(model_dir: Path, state: dict[str, torch.Tensor], num_shards: int) -> None:
    """What older transformers wrote with safe_serialization=False and a small shard size."""
    names = list(state)
    weight_map = {}
    for i in range(num_shards):
        shard = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        part = names[i::num_shards]
        torch.save({k: state[k] for k in part}, model_dir / shard)
        weight_map.update({k: shard for k in part})
    (model_dir / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def variants(tiny_llama, reference, tmp_path_factory) -> dict[str, Path]:
    """The tiny model saved in each supported layout."""
    cfg, model = tiny_llama
    root = tmp_path_factory.mktemp("hf")
    dirs = {name: root / name for name in ("single", "sharded", "bf16", "bin", "bin_sharded")}
    model.save_pretrained(dirs["single"])
    model.save_pretrained(dirs["sharded"], max_shard_size=40_000)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(dirs["bf16"])
    # transformers 5 dropped safe_serialization=False: write the .bin layouts directly.
    for name in ("bin", "bin_sharded"):
        cfg.save_pretrained(dirs[name])
    torch.save(reference, dirs["bin"] / "pytorch_model.bin")
    _save_bin_sharded(dirs["bin_sharded"], reference, 3)
    return dirs


@pytest.mark.parametrize("variant", ["single", "sharded", "bin", "bin_sharded"])
def test_variants_yield_reference_tensors(variants, reference, variant):
    got = dict(iter_weights(str(variants[variant]), None, torch.float32))
    assert set(got) == set(reference)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name


def test_sharded_layout_has_several_shards(variants):
    files = find_weight_files(str(variants["sharded"]))
    assert len(files) >= 3 and all(f.suffix == ".safetensors" for f in files)
    assert len(find_weight_files(str(variants["bin_sharded"]))) == 3


def test_bf16_checkpoint_equals_rounded_reference(variants, reference):
    as_fp32 = dict(iter_weights(str(variants["bf16"]), None, torch.float32))
    as_bf16 = dict(iter_weights(str(variants["bf16"]), None, torch.bfloat16))
    assert set(as_fp32) == set(as_bf16) == set(reference)
    for name, ref in reference.items():
        rounded = ref.to(torch.bfloat16)
        assert as_bf16[name].dtype == torch.bfloat16
        assert torch.equal(as_bf16[name], rounded), name
        assert torch.equal(as_fp32[name], rounded.float()), name


def _sequence_logprobs(model_dir: Path) -> list[torch.Tensor]:
    """pagedllm's log-softmax at every position of a few fixed sequences, float32 engine."""
    from pagedllm import LLM
    from tests.utils import pagedllm_sequence_logprobs, random_prompts

    llm = LLM(str(model_dir), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16,
              max_model_len=64, attention_backend="torch_ref")
    return [pagedllm_sequence_logprobs(llm, seq) for seq in random_prompts(3, 128, 8, 40, seed=3)]


def test_layouts_give_the_same_logits(variants, tiny_llama, tmp_path):
    """Sharded == single-file fp32 exactly. The bf16 checkpoint equals, exactly, the fp32
    model with its weights rounded to bf16 (bf16 widens to fp32 without loss), and the
    unrounded fp32 model within bf16 rounding error."""
    rounded = tmp_path / "rounded"
    copy.deepcopy(tiny_llama[1]).to(torch.bfloat16).to(torch.float32).save_pretrained(rounded)
    single, sharded, bf16, single_rounded = (
        _sequence_logprobs(variants["single"]), _sequence_logprobs(variants["sharded"]),
        _sequence_logprobs(variants["bf16"]), _sequence_logprobs(rounded))
    for i in range(len(single)):
        assert torch.equal(sharded[i], single[i])
        assert torch.equal(bf16[i], single_rounded[i])
        assert not torch.equal(bf16[i], single[i])  # the rounding is visible in the logits
        torch.testing.assert_close(bf16[i], single[i], atol=1e-2, rtol=0)


def test_fp32_checkpoint_converts_to_requested_dtype(variants, reference):
    got = dict(iter_weights(str(variants["single"]), None, torch.float16))
    assert all(got[n].dtype == torch.float16 and torch.equal(got[n], reference[n].half())
               for n in reference)


def test_stream_is_lazy(variants):
    stream = iter_weights(str(variants["sharded"]), None, torch.float32)
    name, tensor = next(stream)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)
    stream.close()


def test_convert_keeps_integer_tensors():
    ids = torch.arange(4)
    assert convert(ids, torch.bfloat16) is ids
    assert convert(torch.ones(2), torch.bfloat16).dtype == torch.bfloat16


def test_missing_weights_raise_model_load_error(tmp_path, variants):
    with pytest.raises(ModelLoadError, match="no weights found"):
        list(iter_weights(str(tmp_path), None, torch.float32))
    with pytest.raises(ModelLoadError, match="does not exist"):
        iter_weights(str(tmp_path / "nope"), None, torch.float32)
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((variants["sharded"] / "model.safetensors.index.json").read_text())
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="missing"):
        list(iter_weights(str(broken), None, torch.float32))
    with pytest.raises(ModelLoadError, match="weight format"):
        detect_format(str(tmp_path / "model.onnx"))


def test_load_tokenizer_from_hf_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<eos>": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<eos>{% endfor %}"
    tok.save_pretrained(tmp_path / "tok")
    for loaded in (load_tokenizer(str(tmp_path / "tok")),
                   load_tokenizer(str(tmp_path / "model"), str(tmp_path / "tok"))):
        assert loaded("hello world foo").input_ids == [1, 2, 0]
        assert loaded.apply_chat_template([{"role": "user", "content": "hello"}],
                                          tokenize=False) == "hello<eos>"
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(tmp_path / "empty"))


def test_load_formats_read_only_their_files(variants, reference, tmp_path):
    """--load-format safetensors / pt read only those files (a directory holding both
    reads the one asked for); a path of another kind is an error naming it."""
    both = tmp_path / "both"
    both.mkdir()
    for name in ("model.safetensors", "config.json"):
        (both / name).write_bytes((variants["single"] / name).read_bytes())
    halved = {k: v / 2 for k, v in reference.items()}
    torch.save(halved, both / "pytorch_model.bin")
    for load_format, expected in (("auto", reference), ("safetensors", reference),
                                  ("pt", halved)):
        got = dict(iter_weights(str(both), None, torch.float32, load_format=load_format))
        assert all(torch.equal(got[n], expected[n]) for n in reference), load_format
    with pytest.raises(ModelLoadError, match="expected model.safetensors or "
                                             "model.safetensors.index.json"):
        list(iter_weights(str(variants["bin"]), None, torch.float32,
                          load_format="safetensors"))
    with pytest.raises(ModelLoadError, match="expected pytorch_model.bin"):
        list(iter_weights(str(variants["sharded"]), None, torch.float32, load_format="pt"))
    with pytest.raises(ModelLoadError, match="--load-format gguf cannot read .* a Hugging "
                                             "Face directory"):
        iter_weights(str(variants["single"]), None, torch.float32, load_format="gguf")


def test_dummy_weights_run_a_config_only_directory(variants, tmp_path):
    """--load-format dummy reads no weights: a directory with only config.json runs,
    on small random weights drawn from the seed (the same tokens on every run)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.errors import ConfigError
    from pagedllm.worker.model_loader import _fill_dummy_weights

    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((variants["single"] / "config.json").read_bytes())
    params = SamplingParams(max_tokens=6, temperature=0)
    kwargs = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    runs = [LLM(str(config_only), load_format="dummy", **kwargs).generate(
        [[1, 2, 3]], params)[0].outputs[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 6
    modules = [torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
               for _ in range(2)]
    for module in modules:
        _fill_dummy_weights(module, seed=0)
    for a, b in zip(*(module.parameters() for module in modules)):
        assert torch.equal(a, b) and 0 < a.abs().max() <= 1e-3
    with pytest.raises(ModelLoadError, match="no weights found"):
        LLM(str(config_only), **kwargs)
    with pytest.raises(ConfigError, match="dummy"):
        LLM(str(config_only), load_format="dummy", quantization="gguf", **kwargs)
