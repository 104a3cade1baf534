"""Helpers for tests: tiny random HF models and a transformers greedy reference."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def perturb(model, scale: float = 0.02) -> None:
    """Add noise to every parameter (random init leaves norms all-ones and biases zero,
    where bugs could hide)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def save_tiny_model(path: Path, config, seed: int = 0, dtype=torch.float32) -> Path:
    """Build a random `transformers` model from `config`, save it as safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb(model)
    model.to(dtype).save_pretrained(path)
    return path


def random_prompts(n: int, vocab_size: int, min_len: int, max_len: int,
                   seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(n)]


def hf_greedy(model_path: Path, prompts: list[list[int]], max_new_tokens: int,
              ) -> list[list[int]]:
    """transformers' own generate, greedy, float32, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def hf_greedy_no_eos(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain argmax decoding with transformers' forward + its KV cache, never stopping at
    EOS and never masking it (generate's min_new_tokens would mask EOS, changing argmax)."""
    out_ids: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            out_ids.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return out_ids


def pagedllm_sequence_logprobs(llm, token_ids: list[int], chunk_size: int | None = None,
                               ) -> torch.Tensor:
    """log_softmax of pagedllm's logits at every position of one sequence ([len, vocab]
    float32): row i is the distribution of the token after token_ids[:i + 1].

    Runs the engine's loaded model directly (no scheduler) over a private KV cache, so the
    engine's cache and prefix-cache contents stay untouched. `chunk_size` splits the
    prefill into chunks that attend to the earlier, cached ones, as chunked prefill does.
    """
    import numpy as np

    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.worker.memory import attention_layers

    runner = llm.llm_engine.engine_core.executor.runner
    model, device, block_size = runner.model, runner.device, runner.block_size
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    layers = attention_layers(model)
    saved = [layer.kv_cache for layer in layers]
    # Block 0 is the null block; the sequence owns blocks 1..num_blocks in order, so
    # position p lives in slot (1 + p // block_size) * block_size + p % block_size.
    block_table = torch.arange(1, num_blocks + 1, dtype=torch.int32, device=device)[None]
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    chunk_size = chunk_size or num_tokens
    logits = []
    try:
        for layer, cache in zip(layers, saved):
            spec = layer.spec
            layer.kv_cache = torch.zeros(
                (2, num_blocks + 1, block_size, spec.num_kv_heads, spec.head_size),
                dtype=cache.dtype, device=device)
        with torch.inference_mode():
            for start in range(0, num_tokens, chunk_size):
                end = min(num_tokens, start + chunk_size)
                positions = torch.arange(start, end, device=device)
                qsl, seq_lens = np.array([0, end - start]), np.array([end])
                md = AttentionMetadata(
                    num_reqs=1, num_actual_tokens=end - start,
                    query_start_loc=torch.from_numpy(qsl).to(device, torch.int32),
                    seq_lens=torch.from_numpy(seq_lens).to(device, torch.int32),
                    block_table=block_table, slot_mapping=positions + block_size,
                    max_query_len=end - start, max_seq_len=end,
                    query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
                hidden = model(ids[start:end], positions, md)
                logits.append(model.compute_logits(hidden).float())
    finally:
        for layer, cache in zip(layers, saved):
            layer.kv_cache = cache
    return torch.log_softmax(torch.cat(logits), dim=-1).cpu()


def hf_sequence_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of one sequence ([len, vocab] float32),
    aligned with `pagedllm_sequence_logprobs`."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def chosen_logprobs(logprobs: torch.Tensor, prompt_len: int, output_ids: list[int],
                    ) -> torch.Tensor:
    """Log-probabilities [len(output_ids)] of the generated tokens, from sequence
    logprobs of prompt + output_ids (token j was chosen at row prompt_len - 1 + j)."""
    rows = torch.arange(prompt_len - 1, prompt_len - 1 + len(output_ids))
    return logprobs[rows, torch.tensor(output_ids)]


def scale_saved_weights(path: Path, scales: dict[str, float]) -> Path:
    """Multiply, in place, every tensor of a saved tiny model whose name contains a key of
    `scales` by its value: sharper attention scores, logits or router choices, so that
    soft-caps bind and positional / windowing bugs change the outputs."""
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    for name, tensor in tensors.items():
        for key, factor in scales.items():
            if key in name:
                tensor.mul_(factor)
    save_file(tensors, file, metadata={"format": "pt"})
    return Path(path)


def tiny_llama_config(**overrides):
    """The tiny Llama most engine tests share: 2 layers, hidden 64, GQA 4:2, vocab 256,
    untied head, no special tokens (so greedy runs never stop early)."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
    kw.update(overrides)
    return LlamaConfig(**kw)


# Word pieces of the tiny BERT's tokenizer (save_tiny_bert); BERT's five special tokens
# first, as in bert-base-uncased's vocab.txt order of [PAD] [UNK] [CLS] [SEP] [MASK].
TINY_BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz",
                   *".,!?'", "the", "a", "cat", "dog", "sat", "on", "mat", "man", "is",
                   "play", "guitar", "paris", "capital", "of", "france", "hello", "world",
                   "##s", "##ing", "##ed", "##er", "##ly"]


def save_tiny_bert(path: Path, seed: int = 0, **overrides) -> Path:
    """A random `transformers` BertModel (pooler included, as real checkpoints) and a
    WordPiece tokenizer over TINY_BERT_VOCAB, saved as an HF directory (float32)."""
    from transformers import BertConfig, BertModel, BertTokenizer

    kw = dict(vocab_size=len(TINY_BERT_VOCAB) + 8, hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
              type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**kw))
    perturb(model)
    model.save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(TINY_BERT_VOCAB)}).save_pretrained(path)
    return path


def save_tiny_cross_encoder(path: Path, seed: int = 0, activation: str | None = None,
                            **overrides) -> Path:
    """A random `transformers` BertForSequenceClassification with one label (a
    cross-encoder) and TINY_BERT_VOCAB's tokenizer, float32. `activation`: the
    sentence-transformers activation its config names (None: the default, a sigmoid).
    Weights perturbed by 0.2 (not 0.02) so that pairs get visibly different scores."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    kw = dict(vocab_size=len(TINY_BERT_VOCAB) + 8, hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
              type_vocab_size=2, hidden_act="gelu", num_labels=1)
    kw.update(overrides)
    config = BertConfig(**kw)
    if activation is not None:
        config.sentence_transformers = {"activation_fn": activation}
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config)
    perturb(model, 0.2)
    model.save_pretrained(path)
    BertTokenizer(vocab={w: i for i, w in enumerate(TINY_BERT_VOCAB)}).save_pretrained(path)
    return Path(path)


LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj")


def save_tiny_lora(path: Path, model, rank: int = 4, alpha: float = 8.0,
                   targets: tuple[str, ...] = LLAMA_LORA_TARGETS, seed: int = 0,
                   std: float = 0.2, **config_extra) -> Path:
    """A random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for
    every linear named in `targets` of `model` (a saved model's directory, or its HF
    config). B is random too (PEFT starts it at zero), so the adapter changes the
    outputs."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model if not isinstance(model, (str, Path)) else AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] in targets:
            prefix = f"base_model.model.{name}.lora_"
            tensors[prefix + "A.weight"] = torch.randn(rank, module.in_features,
                                                       generator=gen) * std
            tensors[prefix + "B.weight"] = torch.randn(module.out_features, rank,
                                                       generator=gen) * std
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "bias": "none", "lora_dropout": 0.0,
              **config_extra}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def apply_lora_hooks(model, adapter_path: Path) -> list:
    """Make a transformers model compute as PEFT's unmerged LoRA does: each adapted
    Linear's output += scale * (x A^T) B^T. Returns the hook handles."""
    import json
    import math

    from safetensors.torch import load_file

    config = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(Path(adapter_path) / "adapter_model.safetensors")
    modules = dict(model.named_modules())
    handles = []
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key[len("base_model.model."):-len(".lora_A.weight")]
        b = tensors[key.replace("lora_A", "lora_B")]

        def hook(mod, inputs, out, a=a.float(), b=b.float()):
            return out + scale * (inputs[0].float() @ a.T) @ b.T
        handles.append(modules[name].register_forward_hook(hook))
    return handles


def save_scripted_llama(path: Path, successors: dict[str, str],
                        chat_template: str | None = None) -> Path:
    """A Llama that recites: greedy decoding after word w writes successors[w] (words
    without one are followed by the EOS word "</s>"), and a whitespace word-level
    tokenizer over those words, saved as an HF directory (float32).

    How: the embedding of word t is one-hot at t, every layer writes zero into the
    residual stream (o_proj and down_proj are zero), so the final norm sees word t alone,
    and the LM head maps it to its successor's logit (80, every other logit 0). Tests
    script exact outputs with it (tags, calls) that a random model would never write.
    """
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    words = ["</s>", "<unk>"]
    for pair in successors.items():
        words += [w for w in pair if w not in words]
    vocab = {w: i for i, w in enumerate(words)}
    hidden = 64
    assert len(words) <= hidden, "one-hot embeddings need hidden_size >= vocabulary"
    config = tiny_llama_config(vocab_size=len(words), hidden_size=hidden,
                               eos_token_id=vocab["</s>"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {name: p.detach().clone() for name, p in model.state_dict().items()}
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
        elif "norm" in name:
            tensor.fill_(1.0)
    embed = torch.zeros(len(words), hidden)
    embed[range(len(words)), range(len(words))] = 1.0
    head = torch.zeros(len(words), hidden)
    for w, i in vocab.items():
        head[vocab[successors.get(w, "</s>")], i] = 10.0
    tensors["model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = head
    model.config.save_pretrained(path)
    save_file(tensors, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        eos_token="</s>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return Path(path)


ROBERTA_CORPUS = ["the cat sat on the mat", "a dog is playing guitar", "hello world",
                  "paris is the capital of france", "the man is on the mat, the cat sat"]


def save_tiny_roberta(path: Path, architecture: str = "XLMRobertaModel", seed: int = 0,
                      **overrides) -> Path:
    """A random `transformers` XLM-RoBERTa (`architecture`: XLMRobertaModel or
    XLMRobertaForSequenceClassification, one label unless num_labels says) and a
    byte-level BPE tokenizer trained here on a few sentences, float32. Perturbed by 0.2
    so that texts get visibly different outputs."""
    import transformers as tf
    from tokenizers import ByteLevelBPETokenizer

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(ROBERTA_CORPUS, vocab_size=300, min_frequency=1,
                            special_tokens=specials)
    tokenizer = tf.RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>",
                                        eos_token="</s>", sep_token="</s>",
                                        cls_token="<s>", unk_token="<unk>",
                                        pad_token="<pad>", mask_token="<mask>")
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=128, max_position_embeddings=66,
              type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
              num_labels=1)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = getattr(tf, architecture)(tf.XLMRobertaConfig(**kw))
    perturb(model, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def word_tokenizer(words: list[str], eos: str = "</s>"):
    """A whitespace word-level fast tokenizer over `words` (ids in list order), with
    "<unk>" for anything else and `eos` as its EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                         unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                   eos_token=eos)


# The words of tiny models' word tokenizers: </s>, <unk>, w0 .. w249.
TINY_WORDS = ["</s>", "<unk>"] + [f"w{i}" for i in range(250)]


def save_tiny_decoder_classifier(path: Path, model_type: str = "llama", num_labels: int = 1,
                                 seed: int = 0, **overrides) -> Path:
    """A random `transformers` <Family>ForSequenceClassification (the tiny Llama's
    shape; model_type llama, qwen2 or qwen3) with a word tokenizer over TINY_WORDS,
    saved as an HF directory (float32)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    base = tiny_llama_config().to_dict()
    base = {k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "max_position_embeddings",
                                 "tie_word_embeddings")}
    config = AutoConfig.for_model(model_type, **base, num_labels=num_labels,
                                  pad_token_id=None, bos_token_id=None, eos_token_id=None,
                                  **overrides)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    perturb(model, 0.2)
    model.save_pretrained(path)
    word_tokenizer(TINY_WORDS).save_pretrained(path)
    return Path(path)


# LLaVA-1.5's chat template (llava-hf's): images first, then the text, per message.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def save_tiny_llava(path: Path, seed: int = 0, image_size: int = 28, patch_size: int = 7,
                    strategy: str = "default", feature_layer=-2, **text_overrides) -> Path:
    """A random `transformers` LlavaForConditionalGeneration (a 3-layer CLIP vision tower
    of hidden 32, the tiny Llama decoder), its CLIP image processor (PIL backend, to
    image_size) and a word-level tokenizer ("w0".."w249", "<image>" = the image token,
    </s>, <unk>) with LLaVA-1.5's chat template, saved as an HF directory (float32)."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    words = TINY_WORDS + ["ASSISTANT:", "USER:"]
    image_token = len(words)
    words.append("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=image_size,
                              patch_size=patch_size, projection_dim=32)
    text = tiny_llama_config(**text_overrides)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                         vision_feature_select_strategy=strategy,
                         vision_feature_layer=feature_layer,
                         image_seq_length=(image_size // patch_size) ** 2)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    perturb(model)
    model.save_pretrained(path)
    CLIPImageProcessorPil(size={"shortest_edge": image_size},
                          crop_size={"height": image_size, "width": image_size}
                          ).save_pretrained(path)
    tokenizer = word_tokenizer(words)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return Path(path)


def random_image(seed: int, width: int = 40, height: int = 32):
    """A PIL RGB image of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def hf_llava_greedy(model_path: Path, prompt_ids: list[int], images: list,
                    max_new_tokens: int) -> list[int]:
    """transformers' LLaVA, greedy, float32: `prompt_ids` with each image's placeholder
    run expanded already, the images through the model's own image processor."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_path,
                                                          dtype=torch.float32).eval()
    kwargs = {}
    if images:
        processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")
        kwargs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
    x = torch.tensor([prompt_ids])
    with torch.no_grad():
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                           max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                           pad_token_id=0, **kwargs)
    return y[0, len(prompt_ids):].tolist()
