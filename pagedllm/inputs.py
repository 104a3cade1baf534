"""The prompt forms `LLM.generate` / `chat` / `embed` take, as vLLM's `vllm.inputs` names
them: plain dicts (any dict with these keys will do; these only type them)."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, Union


class TextPrompt(TypedDict):
    """Text, tokenized by the engine."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]
    """{"image": an image or a list of them} (multimodal models)."""
    cache_salt: NotRequired[str]
    """Only prompts with the same salt share prefix-cache blocks (vLLM's)."""


class TokensPrompt(TypedDict):
    """Token ids, taken as they are (`prompt` is only the text outputs echo)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    """Input embeddings in place of the prompt's tokens (the engine started with
    enable_prompt_embeds): a tensor [tokens, hidden_size], float, of a Llama-shaped
    model. The request's outputs have prompt_token_ids None."""

    prompt_embeds: Any


# A prompt: text, a TextPrompt, TokensPrompt or EmbedsPrompt dict, or a list of token ids.
PromptType = Union[str, TextPrompt, TokensPrompt, EmbedsPrompt, list[int]]
