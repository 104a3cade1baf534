"""InputProcessor: user prompts (text, token ids or embeddings) -> validated Requests."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from pagedllm.config import LoRAConfig, ModelConfig
from pagedllm.engine.pooling_options import check_dimensions
from pagedllm.engine.prompt_embeds import (PLACEHOLDER_ID, check_embeds,
                                           check_embeds_params, embeds_input,
                                           prompt_embeds_of)
from pagedllm.errors import InvalidRequestError
from pagedllm.inputs import PromptType
from pagedllm.lora.adapter import AdapterChecks
from pagedllm.lora_request import LoRARequest
from pagedllm.mm_inputs import ImageInput, PromptEmbedsInput
from pagedllm.pooling_params import PoolingParams
from pagedllm.reasoning import (ReasoningGate, ReasoningTokens, get_reasoning_format,
                                tokens_of)
from pagedllm.request import Request
from pagedllm.sample.constraint_check import ConstraintChecker
from pagedllm.sampling_params import SamplingParams



class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any | None,
                 lora_config: LoRAConfig | None = None,
                 reasoning_parser: str | None = None,
                 constraints: ConstraintChecker | None = None,
                 logits_processors: tuple[type, ...] = (),
                 disable_any_whitespace: bool = False,
                 reasoning_end_str: str | None = None) -> None:
        """`constraints` checks structured-output constraints (default: parsed in the
        caller's thread, no limits); `logits_processors`: the custom processors' classes,
        whose validate_params each request passes."""
        # The engine's default for every grammar (structured_outputs_config).
        self.disable_any_whitespace = disable_any_whitespace
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.hf_config.vocab_size
        self.max_logprobs = model_config.max_logprobs
        self.logits_processors = logits_processors
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id_of(tokenizer, model_config.hf_config)
        # generation_config.json's other end-of-generation tokens: stop tokens of every
        # request that does not ignore EOS (vLLM's rule).
        self.extra_eos_token_ids = [t for t in model_config.generation_eos_token_ids
                                    if t != self.eos_token_id and 0 <= t < self.vocab_size]
        self.architecture = model_config.architecture
        self.is_encoder_only = model_config.is_encoder_only
        self.default_pooling_type = model_config.default_pooling_type
        self.model_config = model_config  # pooling defaults and Matryoshka checks
        self.pooling_task = model_config.pooling_task
        self.can_generate = model_config.can_generate
        self.runner_refusal = model_config.runner_refusal
        self.constraints = constraints or ConstraintChecker()
        # None: LoRA is off and a request naming an adapter is refused.
        self.adapters = (AdapterChecks(model_config.hf_config, lora_config.max_lora_rank)
                         if lora_config is not None else None)
        self.reasoning = _reasoning_tokens(reasoning_parser, tokenizer, reasoning_end_str)
        self.enable_prompt_embeds = model_config.enable_prompt_embeds
        self.hidden_size = model_config.hf_config.get_text_config().hidden_size
        # The model's image processor (None: a text model, and images are refused).
        self.images = None
        self.language_model_only = model_config.language_model_only
        if model_config.image_token_id is not None:
            from pagedllm.multimodal.processor import ImageProcessor

            self.images = ImageProcessor(model_config.path, model_config.hf_config,
                                         model_config.max_images_per_prompt,
                                         model_config.trust_remote_code,
                                         model_config.mm_processor_kwargs)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string or token ids, got "
                                      f"{type(prompt).__name__}")
        if self.tokenizer is None:
            raise InvalidRequestError("this engine was started without a tokenizer: "
                                      "pass prompt_token_ids")
        return prompt, self.tokenizer.encode(prompt) if prompt else []

    def process(self, req_id: str, prompt: PromptType,
                params: SamplingParams | PoolingParams,
                arrival_time: float | None = None, priority: int = 0,
                deadline: float | None = None, lora_request: LoRARequest | None = None,
                ) -> tuple[Request, str | None]:
        """A validated Request and the prompt text (None for token-id prompts).

        `priority` and `deadline` (absolute `time.monotonic()` time) go to the scheduler
        as they are; the caller checks them against the scheduling policy. PoolingParams
        make an embedding request (prefill only, see request.py). `lora_request` runs it
        with that adapter (checked here: LoRA on, the adapter's files fit the model).
        """
        self.check_lora(lora_request)
        salt = check_cache_salt(prompt.get("cache_salt") if isinstance(prompt, dict)
                                else None)
        embeds = prompt_embeds_of(prompt)
        if isinstance(params, PoolingParams):
            if embeds is not None:
                raise InvalidRequestError("prompt_embeds in embedding, score or "
                                          "classification prompts are not supported")
            refusal = self.runner_refusal(pooling=True)
            if refusal:
                raise InvalidRequestError(refusal)
            text, ids = self.tokenize(prompt)
            if prompt_images(prompt):
                raise InvalidRequestError("images in embedding, score or classification "
                                          "prompts are not supported")
            ids, _ = self.with_images(ids, [], None)
            text, ids = self._truncated(text, ids, params.truncate_prompt_tokens)
            self.validate_prompt(ids)
            self.check_pooling_task(params, len(ids))
            params = self.resolved_pooling(params)
            # Placeholder sampling params: nothing samples for an embedding request.
            request = Request(req_id, ids, SamplingParams(max_tokens=1), self.eos_token_id,
                              arrival_time, priority=priority, max_tokens=1,
                              deadline=deadline, pooling_params=params,
                              lora_request=lora_request, cache_salt=salt)
            return request, text
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got "
                                      f"{type(params).__name__}")
        self.check_generation()
        if embeds is not None:
            text, ids, images = None, *self._embedded(embeds, params)
        else:
            text, ids = self.tokenize(prompt)
            ids, images = self.with_images(ids, prompt_images(prompt),
                                            params.truncate_prompt_tokens)
            text, ids = self._truncated(text, ids, params.truncate_prompt_tokens)
        self.validate_prompt(ids)
        self.validate_params(params)
        params = self._with_generation_eos(params)
        # Room left for output; generation also stops at max_model_len in the scheduler.
        max_tokens = params.max_tokens or max(1, self.max_model_len - len(ids))
        request = Request(req_id, ids, params, self.eos_token_id, arrival_time,
                          priority=priority, max_tokens=max_tokens, deadline=deadline,
                          lora_request=lora_request, mm_inputs=images, cache_salt=salt)
        if self.reasoning is not None and (params.structured_outputs is not None
                                           or params.thinking_token_budget is not None):
            request.reasoning_gate = ReasoningGate.for_prompt(self.reasoning, ids,
                                                              params.thinking_token_budget)
        return request, text

    def _embedded(self, embeds: Any, params: SamplingParams,
                  ) -> tuple[list[int], list[PromptEmbedsInput]]:
        """(placeholder ids, [the rows]) of a prompt given as embeddings."""
        if not self.enable_prompt_embeds:
            raise InvalidRequestError("prompt_embeds needs the engine started with "
                                      "enable_prompt_embeds=True (--enable-prompt-embeds)")
        check_embeds_params(params)
        if isinstance(embeds, PromptEmbedsInput):
            # Checked, copied and hashed already (the server does it off its event
            # loop), its truncation applied.
            if embeds.rows.ndim != 2 or embeds.rows.shape[1] != self.hidden_size:
                raise InvalidRequestError(f"prompt_embeds must have shape [tokens, "
                                          f"{self.hidden_size}]")
            ids = [PLACEHOLDER_ID] * embeds.length
            self.validate_prompt(ids)
            return ids, [embeds]
        rows = check_embeds(embeds, self.hidden_size)
        kept = truncate_prompt([PLACEHOLDER_ID] * rows.shape[0],
                               params.truncate_prompt_tokens, self.max_model_len)
        self.validate_prompt(kept)  # before the rows are copied and hashed
        return kept, [embeds_input(rows[rows.shape[0] - len(kept):])]

    def _with_generation_eos(self, params: SamplingParams) -> SamplingParams:
        """A copy of `params` that also stops at the generation config's EOS tokens."""
        missing = [t for t in self.extra_eos_token_ids if t not in params.stop_token_ids]
        if params.ignore_eos or not missing:
            return params
        params = copy.copy(params)  # one SamplingParams may be shared by many prompts
        params.stop_token_ids = list(params.stop_token_ids) + missing
        return params

    def with_images(self, ids: list[int], images: list[Any],
                     truncate_prompt_tokens: int | None) -> tuple[list[int], list[ImageInput]]:
        """The prompt's ids with each image's placeholder run expanded, and its images
        (a multimodal model checks every prompt's placeholders, images or not)."""
        if self.images is None or (images and self.language_model_only):
            if images:
                raise InvalidRequestError(
                    "images are not taken: the engine serves the language model only "
                    "(--language-model-only)" if self.language_model_only else
                    f"this model ({self.architecture}) does not take images")
            return ids, []
        if images and truncate_prompt_tokens is not None:
            raise InvalidRequestError("truncate_prompt_tokens cannot be used with images "
                                      "(it could cut an image's placeholder tokens)")
        return self.images.image_inputs(ids, images)

    def _truncated(self, text: str | None, ids: list[int], truncate_prompt_tokens: int | None,
                   ) -> tuple[str | None, list[int]]:
        """(text, ids) of the prompt as truncate_prompt_tokens leaves it; the text of a
        truncated prompt is its kept tokens' (None without a tokenizer)."""
        kept = truncate_prompt(ids, truncate_prompt_tokens, self.max_model_len)
        if len(kept) == len(ids):
            return text, ids
        return (self.tokenizer.decode(kept) if self.tokenizer is not None else None), kept

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got "
                                      f"{type(lora_request).__name__}")
        if self.adapters is None:
            raise InvalidRequestError(f"lora_request {lora_request.lora_name!r} needs LoRA "
                                      f"enabled: start the engine with enable_lora=True "
                                      f"(--enable-lora)")
        self.adapters.check(lora_request)

    def resolved_pooling(self, params: PoolingParams) -> PoolingParams:
        """A copy of `params` (one may be shared by many prompts) with what it leaves
        unset taken from the model: its pooling type, and its pooler_config's
        use_activation (else on) and dimensions."""
        defaults = self.model_config.pooler
        embed = params.task == "embed"
        activation = params.use_activation
        if activation is None and embed:
            activation = params.normalize
        if activation is None:
            activation = defaults.use_activation is not False
        dimensions = params.dimensions
        if embed and dimensions is None:
            dimensions = defaults.dimensions
        return replace(params, pooling_type=params.pooling_type or self.default_pooling_type,
                       use_activation=activation, dimensions=dimensions,
                       normalize=activation if embed else params.normalize)

    def check_pooling_task(self, params: PoolingParams, num_tokens: int) -> None:
        """A cross-encoder scores pairs (and, classifying, single texts: a reward
        model's use) and a classifier only classifies (their head reads the pooled
        state, raw); every other model only embeds."""
        one_label_classify = params.task == "classify" and self.pooling_task == "score"
        if params.task != self.pooling_task and not one_label_classify:
            does = {"score": "is a cross-encoder: it scores pairs of texts (LLM.score, "
                             "/score, /rerank)",
                    "classify": "is a classifier: it gives label probabilities "
                                "(LLM.classify, /classify)",
                    "embed": "embeds (and scores pairs by the cosine similarity of their "
                             "embeddings: LLM.score does that)"}
            raise InvalidRequestError(f"task {params.task!r} is not this model's: "
                                      f"{self.architecture} {does[self.pooling_task]}")
        if params.task == "embed":
            if params.dimensions is not None:
                check_dimensions(params.dimensions, self.model_config, InvalidRequestError)
            return
        pooled = self.default_pooling_type
        if params.pooling_type not in (None, pooled) or params.normalize:
            raise InvalidRequestError(f"a {params.task} request reads the model's pooled "
                                      f"state as it is: pooling_type {pooled!r} (or None), "
                                      f"normalize False or None")
        if params.token_type_start is not None and params.token_type_start >= num_tokens:
            raise InvalidRequestError(f"token_type_start {params.token_type_start} is past "
                                      f"the prompt's {num_tokens} tokens")

    def check_generation(self) -> None:
        """Encoders and sequence classifiers have no LM head to generate with; the
        pooling runner takes no generation."""
        refusal = self.runner_refusal(pooling=False)
        if refusal:
            raise InvalidRequestError(refusal)
        if self.is_encoder_only and self.pooling_task == "embed":
            raise InvalidRequestError(
                f"this model ({self.architecture}) does not support generation: it is an "
                f"encoder-only embedding model; use embeddings (LLM.embed, /v1/embeddings)")
        if not self.can_generate:
            raise InvalidRequestError(
                f"this model ({self.architecture}) does not support generation: it has a "
                f"classification head; use scores or classification (LLM.score, "
                f"LLM.classify, /score, /classify)")

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
                f"length of {self.max_model_len}. Make sure that `max_model_len` is no "
                f"smaller than the number of text tokens.")
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of vocabulary (size {self.vocab_size}): "
                                      f"{bad[:5]}")


    def validate_params(self, params: SamplingParams) -> None:
        """Checks that need the vocabulary or the tokenizer (or the custom logits
        processors); tokenizes bad_words."""
        for cls in self.logits_processors:
            try:
                cls.validate_params(params)
            except ValueError as e:  # InvalidRequestError included
                raise InvalidRequestError(f"{cls.__name__}: {e}") from e
        for name in ("logprobs", "prompt_logprobs"):
            check_num_logprobs(name, getattr(params, name), self.max_logprobs,
                               self.vocab_size)
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids",
                     "logprob_token_ids"):
            ids = getattr(params, name) or ()
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} contains token ids out of vocabulary "
                                          f"(size {self.vocab_size}): {bad[:5]}")
        needs_tokenizer = [name for name, used in (
            ("stop", params.stop), ("bad_words", params.bad_words),
            ("structured_outputs", params.structured_outputs)) if used]
        if needs_tokenizer and self.tokenizer is None:
            raise InvalidRequestError(f"{needs_tokenizer[0]} needs a tokenizer, and this "
                                      f"engine was started without one")
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise InvalidRequestError("thinking_token_budget needs the engine started with a "
                                      "reasoning parser (--reasoning-parser): without one "
                                      "there is no reasoning to bound")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self._tokenize_bad_words(params.bad_words)
        if params.structured_outputs is not None:
            if self.disable_any_whitespace and not params.structured_outputs.disable_any_whitespace:
                params.structured_outputs = replace(params.structured_outputs,
                                                    disable_any_whitespace=True)
            self.constraints.check(params.structured_outputs)

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word as it would appear at the start of the text and after a space (the
        second only when the space makes a different first token), as vLLM does."""
        token_ids: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            token_ids.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                token_ids.append(spaced)
        return token_ids


MAX_CACHE_SALT_CHARS = 128


def check_cache_salt(salt: Any) -> str | None:
    """The salt as given (None: none), or InvalidRequestError: a non-empty string of at
    most MAX_CACHE_SALT_CHARS characters (vLLM's rule)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise InvalidRequestError("cache_salt must be a non-empty string")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} "
                                  f"characters, got {len(salt)}")
    return salt


def prompt_images(prompt: PromptType) -> list[Any]:
    """The images of a prompt's `multi_modal_data` ([] without)."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return []
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict):
        raise InvalidRequestError(f"multi_modal_data must be a dict such as "
                                  f"{{'image': image}}, got {type(data).__name__}")
    other = sorted(set(data) - {"image"})
    if other:
        raise InvalidRequestError(f"multi_modal_data {other[0]!r} is not supported (only "
                                  f"'image')")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def _reasoning_tokens(name: str | None, tokenizer: Any | None,
                      end_str: str | None = None) -> ReasoningTokens | None:
    """The reasoning format's tags in this tokenizer, with `end_str` (what a spent
    thinking budget forces) as ids (None without a parser); ValueError when the model
    has no such tags, or no tokenizer to find them in."""
    if name is None:
        return None
    if tokenizer is None:
        raise ValueError(f"reasoning parser {name!r} needs the tokenizer (it finds the "
                         f"reasoning tags there): do not skip its initialization")
    return tokens_of(get_reasoning_format(name), tokenizer, end_str)


def truncate_prompt(ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens ids (-1: max_model_len; None: all)."""
    if truncate_prompt_tokens is None:
        return ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({max_model_len}). Please, select a smaller truncation size.")
    return ids[-keep:]


def logprobs_cap(max_logprobs: int, vocab_size: int) -> int:
    """Most logprobs per position: max_logprobs, or the vocabulary's size (-1, and at most)."""
    return vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)


def check_num_logprobs(name: str, value: int | None, max_logprobs: int,
                       vocab_size: int) -> None:
    """InvalidRequestError if `value` logprobs per position is over logprobs_cap."""
    cap = logprobs_cap(max_logprobs, vocab_size)
    if value is not None and value > cap:
        raise InvalidRequestError(
            f"Requested {name} of {value}, which is greater than max allowed: {cap} "
            f"(max_logprobs {max_logprobs}, --max-logprobs)")


def eos_token_id_of(tokenizer: Any | None, hf_config: Any) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos
