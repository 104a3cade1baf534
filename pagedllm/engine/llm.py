"""LLM: the offline entry point (generate, chat, embed, score, classify) over an
LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import beam_search
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.scoring import (classifier_params, cosine_score,
                                     cross_encoder_params, encode_pair, score_pairs)
from pagedllm.errors import InvalidRequestError
from pagedllm.inputs import PromptType
from pagedllm.lora_request import LoRARequest
from pagedllm.multimodal.content import has_images, load_images, split_images
from pagedllm.outputs import (BeamSearchOutput, ClassificationOutput,
                              ClassificationRequestOutput, EmbeddingRequestOutput,
                              PoolingOutput, PoolingRequestOutput, RequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from pagedllm.pooling_params import POOLING_TASKS, PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """`LLM(model=None, **engine_args)`; keywords are EngineArgs fields.

    `skip_tokenizer_init=True` runs without a tokenizer (token-id prompts only).
    """

    def __init__(self, model: str | None = None, *, skip_tokenizer_init: bool = False,
                 **kwargs: Any) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown LLM arguments {sorted(unknown)}; "
                            f"valid: {EngineArgs.field_names()}")
        args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args, skip_tokenizer_init)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def shutdown(self) -> None:
        """Release the engine now: tensor-parallel worker processes exit. (Dropping the
        LLM does the same once it is garbage collected, and so does interpreter exit.)"""
        self.llm_engine.shutdown()

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Forget every cached prefix block, so the next prompts are computed afresh (as
        vLLM's LLM.reset_prefix_cache, e.g. between benchmark runs); True when done.
        Between `generate` calls no request holds blocks, so it always is.
        `reset_external`: also delete this model's blocks from the KV store
        (kv_transfer_config)."""
        return self.llm_engine.reset_prefix_cache(reset_external)

    def sleep(self, level: int = 1) -> None:
        """Release memory until `wake_up` (needs enable_sleep_mode=True, as vLLM's):
        level 1 the KV cache, level 2 the weights too (read again from the model's
        files when woken; on CUDA level 1 moves the weights to host memory). The prefix
        cache starts empty after; requests are refused while asleep."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what `sleep` released: `tags` among "weights" and "kv_cache"
        (default both; e.g. the weights first, updated, then the cache)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def update_weights(self, weights: Any) -> None:
        """Load new weights into the model, e.g. a trainer's after each step: (name,
        tensor) pairs or a dict, named as the model's checkpoint names them (HF names;
        fused projections take their q/k/v or gate/up parts), any dtype; weights not
        given keep the files' values. The engine must be idle (between generate calls
        it is); cached prefixes are dropped. A bad name or shape raises ValueError and
        leaves the model as it was. Not for GGUF blocks (dequantize=True loads them
        dense)."""
        self.llm_engine.update_weights(weights)

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        """Run `method` on every rank's worker, as vLLM's: a name of the worker's
        methods (those of `worker_extension_cls` among them) or a function taking the
        worker first, importable by name; its results in rank order. The worker has
        the rank's `model_runner`, `model`, `device` and `rank`. `timeout` is vLLM's
        and not supported (a call runs to its end)."""
        if timeout is not None:
            raise ValueError("collective_rpc's timeout is not supported: a call runs to "
                             "its end")
        return self.llm_engine.collective_rpc(method, args, kwargs)

    def start_profile(self) -> None:
        """Record the model's steps with torch's profiler (needs profiler_dir, or env
        PAGEDLLM_TORCH_PROFILER_DIR / VLLM_TORCH_PROFILER_DIR, as vLLM's)."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop recording; the traces written (Chrome trace JSON, one per worker: open
        them in Perfetto or chrome://tracing)."""
        return self.llm_engine.stop_profile()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling params: the model's
        generation config's defaults (see EngineArgs.generation_config), else
        SamplingParams()."""
        return SamplingParams(**self.llm_engine.config.model.sampling_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        `priority`: one per prompt (lower runs first); needs scheduling_policy="priority"
        unless every value is 0. `lora_request`: a LoRA adapter for every prompt, or one
        per prompt (None: the base model); needs enable_lora=True.
        """
        prompts, params = _one_per_prompt(prompts, sampling_params,
                                          self.get_default_sampling_params(),
                                          "sampling params")
        if priority is None:
            priority = [0] * len(prompts)
        elif not isinstance(priority, Sequence) or isinstance(priority, str):
            raise InvalidRequestError(f"priority must be a list of ints, one per prompt, "
                                      f"got {type(priority).__name__}")
        elif len(priority) != len(prompts):
            raise InvalidRequestError(f"The lengths of prompts ({len(prompts)}) and priority "
                                      f"({len(priority)}) must be the same.")
        # Offline: only the final output of each request is wanted (as vLLM's LLM).
        final = {id(p): _final_only(p) for p in params}
        params = [final[id(p)] for p in params]
        req_ids = self._add_all(prompts, params, priority, _loras(lora_request, len(prompts)))
        return self._run(req_ids, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
              ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (strings or {"prompt_token_ids": [...]}), in
        input order: the model's final hidden states, pooled (default: the model's,
        last token for decoders, mean for BERT unless its sentence-transformers config
        says otherwise) and L2-normalized. Each prompt runs as one prefill-only
        request."""
        prompts, params = _one_per_prompt(prompts, pooling_params, PoolingParams(),
                                          "pooling params")
        bad = [p for p in params if not isinstance(p, PoolingParams)]
        if bad:
            raise InvalidRequestError(f"pooling_params must be PoolingParams, got "
                                      f"{type(bad[0]).__name__}")
        req_ids = self._add_all(prompts, params, [0] * len(prompts),
                                _loras(lora_request, len(prompts)))
        return self._run(req_ids, use_tqdm)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: each prompt's pooled output as a tensor
        (`outputs.data`), in input order. `pooling_task` "embed" gives the embedding
        (as `embed`), "classify" a classifier's label probabilities, "score" a
        cross-encoder's score of the prompt as one text; None: the model's own task.
        `pooling_params` (their `task` set to it) default to what that task reads."""
        task = pooling_task or self.llm_engine.config.model.pooling_task
        if task not in POOLING_TASKS:
            raise InvalidRequestError(f"pooling_task must be one of {POOLING_TASKS} (per-"
                                      f"token tasks are not supported), got {task!r}")
        default = {"embed": PoolingParams(), "classify": classifier_params(),
                   "score": cross_encoder_params(None)}[task]
        prompts, params = _one_per_prompt(prompts, pooling_params, default, "pooling params")
        params = [dataclasses.replace(p, task=task) if isinstance(p, PoolingParams) else p
                  for p in params]
        outs = self.embed(prompts, params, use_tqdm, lora_request)
        import torch  # here: `import pagedllm` stays without torch

        return [PoolingRequestOutput(o.request_id, PoolingOutput(torch.tensor(
            o.outputs.embedding, dtype=torch.float32)), o.prompt_token_ids, o.finished)
            for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """Score pairs of texts (vLLM's LLM.score): `data_1` against each of `data_2`
        (one text), or the two lists pairwise. A cross-encoder
        (BertForSequenceClassification) reads each pair as one prompt and scores it
        with its head (`pooling_params.use_activation` False: its logit); an embedding
        model scores the cosine similarity of the two texts' embeddings. Outputs in
        pair order."""
        activation = pooling_params.use_activation if pooling_params is not None else None
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError("score needs a tokenizer (skip_tokenizer_init is set)")
        pairs = score_pairs(data_1, data_2)
        if self.llm_engine.config.model.is_cross_encoder:
            max_len = self.llm_engine.config.model.max_model_len
            encoded = [encode_pair(tokenizer, a, b, max_len, truncate_prompt_tokens)
                       for a, b in pairs]
            outs = self.embed([{"prompt_token_ids": ids} for ids, _ in encoded],
                              [cross_encoder_params(start, activation)
                               for _, start in encoded],
                              use_tqdm, lora_request)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.embedding[0]),
                                         o.prompt_token_ids) for o in outs]
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        embedded = dict(zip(texts, self.embed(texts, params, use_tqdm, lora_request)))
        outputs = []
        for a, b in pairs:
            u, v = embedded[a], embedded[b]
            outputs.append(ScoringRequestOutput(
                f"{u.request_id}+{v.request_id}",
                ScoringOutput(cosine_score(u.outputs.embedding, v.outputs.embedding)),
                u.prompt_token_ids + v.prompt_token_ids))
        return outputs

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """The label probabilities of every prompt (vLLM's LLM.classify), in input
        order: a sequence classifier (BertForSequenceClassification with several
        labels) runs its head on the [CLS] state, softmax over the labels
        (`pooling_params.use_activation` False: the logits)."""
        activation = pooling_params.use_activation if pooling_params is not None else None
        outs = self.embed(prompts, classifier_params(truncate_prompt_tokens, activation),
                          use_tqdm)
        return [ClassificationRequestOutput(o.request_id,
                                            ClassificationOutput(o.outputs.embedding),
                                            o.prompt_token_ids) for o in outs]

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    ) -> list[BeamSearchOutput]:
        """Beam search over the engine (each step runs every live beam as a one-token
        request with 2 * beam_width logprobs; the prefix cache keeps that cheap);
        `lora_request` as for generate."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return beam_search(self.llm_engine, prompts, params, self._counter,
                           _loras(lora_request, len(prompts)))

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             continue_final_message: bool = False,
             chat_template_content_format: str = "auto",
             ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate.

        `chat_template_content_format` (a text model's): "string" gives the template
        each message's content as one string (text parts joined), "openai" as a list of
        text parts, "auto" as the template reads it (a loop over a content: parts).

        `continue_final_message`: the reply continues the conversation's last message (an
        assistant's, left open by the template) instead of starting a new one; it takes
        the place of add_generation_prompt, as in the server's chat requests.

        `tools`: OpenAI-style tool definitions ({"type": "function", "function": {...}})
        the template renders into the prompt (for templates that support tools); the
        replies are plain text: parse tool calls from them, or use the server's
        tool calling."""
        # Here: jinja2 (reading the template) is not for every `import pagedllm`.
        from pagedllm.engine.content_format import (CONTENT_FORMATS, as_content_format,
                                                    detect_content_format)

        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer (skip_tokenizer_init is set)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        model = self.llm_engine.config.model
        if chat_template_content_format not in CONTENT_FORMATS:
            raise InvalidRequestError(f"chat_template_content_format must be one of "
                                      f"{', '.join(CONTENT_FORMATS)}, got "
                                      f"{chat_template_content_format!r}")
        content_format = chat_template_content_format
        if content_format == "auto":
            template = chat_template or getattr(tokenizer, "chat_template", None)
            content_format = detect_content_format(template if isinstance(template, str)
                                                   else None)
        prompts = []
        for conv in conversations:
            images: list[Any] = []
            if model.image_token_id is not None:
                conv, sources = split_images(list(conv))
                images = load_images(sources)
            elif has_images(conv):
                raise InvalidRequestError(f"this model ({model.architecture}) does not take "
                                          f"images")
            else:
                conv = as_content_format(list(conv), content_format)
            # The template already holds the special tokens: don't let encode add BOS again.
            text = tokenizer.apply_chat_template(
                conv, tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, chat_template=chat_template,
                tools=tools, **(chat_template_kwargs or {}))
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _add_all(self, prompts: Sequence[PromptType],
                 params: Sequence[SamplingParams | PoolingParams],
                 priority: Sequence[int], loras: Sequence[LoRARequest | None]) -> list[str]:
        engine = self.llm_engine
        req_ids: list[str] = []
        try:
            for prompt, sp, prio, lora in zip(prompts, params, priority, loras):
                req_id = str(next(self._counter))
                engine.add_request(req_id, prompt, sp, priority=prio, lora_request=lora)
                req_ids.append(req_id)
        except Exception:
            # All or nothing: a bad prompt must not leave its batch-mates queued.
            engine.abort_request(req_ids)
            raise
        return req_ids

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[Any]:
        """Step until every request is done; their final outputs in `req_ids` order."""
        engine = self.llm_engine
        finished: dict[str, Any] = {}
        pbar = None
        if use_tqdm and len(req_ids) > 1:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(req_ids), desc="Processed prompts", dynamic_ncols=True)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if pbar is not None:
                        pbar.update(1)
        if pbar is not None:
            pbar.close()
        return [finished[r] for r in req_ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    if not isinstance(params, SamplingParams) or (
            params.output_kind == RequestOutputKind.FINAL_ONLY):
        return params  # the input processor rejects non-SamplingParams
    params = params.clone()
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def _loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
           num_prompts: int) -> list[LoRARequest | None]:
    """One LoRA adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Sequence):
        raise InvalidRequestError(f"lora_request must be a LoRARequest or a list of them, "
                                  f"got {type(lora_request).__name__}")
    if len(lora_request) != num_prompts:
        raise InvalidRequestError(f"got {num_prompts} prompts but {len(lora_request)} "
                                  f"lora requests")
    return list(lora_request)


def _one_per_prompt(prompts: PromptType | Sequence[PromptType], params: Any, default: Any,
                    what: str) -> tuple[list[PromptType], list[Any]]:
    """(prompts, params) as two lists of equal length: one prompt becomes a list, one
    params object (or None: `default`) is shared by every prompt."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    params = params if params is not None else default
    if isinstance(params, type(default)):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params)} {what}")
    return list(prompts), list(params)
