"""HF architecture name -> model class, imported lazily when chosen."""

from __future__ import annotations

import importlib

from pagedllm.errors import ModelLoadError

# architecture -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    # Llama + a config-wide sliding window, which LlamaModel reads from the config.
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "GPT2LMHeadModel": ("gpt2", "GPT2LMHeadModel"),
    "OPTForCausalLM": ("opt", "OPTForCausalLM"),
    "GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "BloomForCausalLM": ("bloom", "BloomForCausalLM"),
    # Decoders with a classification head (rerankers, reward models, classifiers).
    "LlamaForSequenceClassification": ("seq_cls", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("seq_cls", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("seq_cls", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("seq_cls", "Qwen3ForSequenceClassification"),
    # Vision-language: CLIP + projector + a Llama-shaped decoder (images in prompts).
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    # Encoder only (embeddings): sentence-transformers' all-MiniLM-L6-v2 and kin.
    "BertModel": ("bert", "BertModel"),
    # Sequence classifiers: with one label a cross-encoder (scores a pair of texts:
    # sentence-transformers' CrossEncoder models such as ms-marco-MiniLM-L-6-v2), with
    # more a classifier (label probabilities).
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    # RoBERTa-family encoders (bge-m3, multilingual-e5; bge-reranker-v2-m3).
    "RobertaModel": ("bert", "RobertaModel"),
    "XLMRobertaModel": ("bert", "RobertaModel"),
    "RobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "RobertaForSequenceClassification"),
}

# Architectures whose attention is bidirectional over each prompt: they keep no KV
# cache, take no prefix-cache hits and only embed or score (they cannot generate).
_ENCODER_ONLY = frozenset({"BertModel", "BertForSequenceClassification", "RobertaModel",
                           "XLMRobertaModel", "RobertaForSequenceClassification",
                           "XLMRobertaForSequenceClassification"})
# Models whose pooled state (an encoder's [CLS], a decoder's last token) goes through a
# classification head: one label scores pairs of texts (LLM.score, /score, /rerank) or
# single texts (LLM.classify, /classify), more classify; they do nothing else.
_SEQUENCE_CLASSIFIERS = frozenset({"BertForSequenceClassification",
                                   "RobertaForSequenceClassification",
                                   "XLMRobertaForSequenceClassification",
                                   "LlamaForSequenceClassification",
                                   "MistralForSequenceClassification",
                                   "Qwen2ForSequenceClassification",
                                   "Qwen3ForSequenceClassification"})


# Architectures whose prompts may hold images (multi_modal_data, image_url parts).
_MULTIMODAL = frozenset({"LlavaForConditionalGeneration"})
# Architectures whose prompts may come as input embeddings (enable_prompt_embeds): the
# Llama-shaped decoders, whose forward takes inputs_embeds in place of the token
# embeddings (and LLaVA's, the same decoder).
_PROMPT_EMBEDS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                            "Qwen3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
                            "Qwen3MoeForCausalLM", "LlavaForConditionalGeneration"})


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def is_encoder_only(architecture: str) -> bool:
    return architecture in _ENCODER_ONLY


def is_multimodal(architecture: str) -> bool:
    return architecture in _MULTIMODAL


def prompt_embeds_architectures() -> list[str]:
    return sorted(_PROMPT_EMBEDS)


def is_sequence_classifier(architecture: str) -> bool:
    return architecture in _SEQUENCE_CLASSIFIERS


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise ModelLoadError(f"model architecture {architecture!r} is not supported; "
                             f"supported: {', '.join(supported_architectures())}")
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(f"pagedllm.models.{module}"), cls)
