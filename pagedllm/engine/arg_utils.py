"""EngineArgs: the user-facing engine options, resolved into an `EngineConfig`.

`EngineArgs` is the single source of truth for user-facing defaults: `LLM(**kwargs)`
takes its fields as keywords and the CLI derives one flag per field (help text from
the field's `help` metadata). Resolving reads the model's HF config (loader/), so it
lives here, above loader/ and below the entry points (as vLLM's engine/arg_utils.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import (DISTRIBUTED_EXECUTOR_BACKENDS, EXPERT_PLACEMENT_STRATEGIES,
                             KV_CACHE_DTYPES, LOAD_FORMATS, LORA_DTYPES,
                             LOGPROBS_MODES, PREEMPTION_MODES, SCHEDULING_POLICIES,
                             CacheConfig,
                             DeviceConfig, EngineConfig, KVEventsConfig, KVTransferConfig,
                             LoRAConfig, ObservabilityConfig,
                             ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, StructuredOutputsConfig,
                             cache_root, default_model_path, env_kv_cache_space,
                             env_num_threads, env_profiler_dir, require_json_object)
from pagedllm.engine.compilation import resolve_graphs
from pagedllm.engine.pooling_options import CONVERTS, converted_architecture, pooler_config
from pagedllm.engine.profiler_options import profiler_options
from pagedllm.errors import ConfigError, ModelLoadError
from pagedllm.kernels.cpu.features import has_avx512_bf16, has_quant_simd
from pagedllm.reasoning import REASONING_FORMATS, get_reasoning_format

logger = logging.getLogger(__name__)

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other names of the same dtypes (its --dtype takes them too).
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
_QUANTIZATIONS = ("auto", "gguf", "none")
_TOKENIZER_MODES = ("auto", "hf")
_CONFIG_FORMATS = ("auto", "hf")
_MODEL_IMPLS = ("auto", "vllm")
_RUNNERS = ("auto", "generate", "pooling")
_GUIDED_DECODING_BACKENDS = ("auto", "xgrammar")
# vLLM's --task values (before --runner), by the runner they chose.
_TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling",
                 "embedding": "pooling", "classify": "pooling", "score": "pooling",
                 "reward": "pooling"}
# Model types whose positions index a learned table: no sequence may outgrow it.
_LEARNED_POSITION_MODEL_TYPES = frozenset({"gpt2", "opt", "bert", "roberta", "xlm-roberta"})
# Learned positions counted from padding_idx + 1: that many rows are never a position.
_OFFSET_POSITION_MODEL_TYPES = frozenset({"roberta", "xlm-roberta"})


# What a Hugging Face id's download leaves out unless told otherwise (vLLM's default).
DEFAULT_IGNORE_PATTERNS = ["original/**/*"]


def _arg(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """User-facing engine options; `LLM(**kw)` keywords and CLI flags come from these fields."""

    model: str | None = _arg(None, "HF model directory, .gguf file or Hugging Face model id "
                                   "org/name (default: bundled SmolLM2-135M-Instruct)")
    tokenizer: str | None = _arg(None, "tokenizer directory or Hugging Face id org/name, "
                                       "when not the model's own")
    runner: str = _arg("auto", "what requests the engine takes, as vLLM's --runner: auto "
                               "(what the model can do: generation and embeddings for a "
                               "decoder, pooling for an encoder or a classifier), "
                               "generate (generation only), pooling (embeddings, scores, "
                               "classification only)", choices=_RUNNERS)
    convert: str = _arg("auto", "as vLLM's --convert: embed serves a generative model's "
                                "embeddings only (runner pooling), classify reads a causal "
                                "LM as its family's sequence classifier (the checkpoint's "
                                "score head, or hf_overrides' classifier_from_token); "
                                "auto / none change nothing", choices=CONVERTS)
    pooler_config: dict[str, Any] | None = _arg(
        None, "defaults of pooling requests, as vLLM's: a JSON object with pooling_type "
              "(LAST, MEAN, CLS), use_activation (embeddings normalized, scores and "
              "classifications through the head's activation), dimensions (Matryoshka "
              "models), logit_mean / logit_sigma (scores calibrated before the "
              "activation)")
    task: str | None = _arg(None, "vLLM's older name of runner: generate, or embed / "
                                  "embedding / classify / score / reward (pooling)",
                            choices=tuple(_TASK_RUNNERS))
    tokenizer_mode: str = _arg("auto", "auto or hf, the same: transformers' tokenizer (as of "
                                       "transformers 5 every tokenizer runs on the "
                                       "tokenizers library; vLLM's slow, mistral and "
                                       "custom modes are not available)",
                               choices=_TOKENIZER_MODES)
    config_format: str = _arg("auto", "the model's config format, as vLLM's: auto or hf "
                                      "(config.json; Mistral's params.json is not read)",
                              choices=_CONFIG_FORMATS)
    model_impl: str = _arg("auto", "whose model implementation runs, as vLLM's: auto or "
                                   "vllm (pagedllm's own; transformers' modeling code is "
                                   "not run)", choices=_MODEL_IMPLS)
    disable_cascade_attn: bool = _arg(
        False, "accepted for vLLM's command lines, where it is deprecated and changes "
               "nothing; here too: the CPU kernels' shared-prefix (cascade) pass gives "
               "the same bits as without it")
    revision: str | None = _arg(None, "branch, tag or commit of a Hugging Face model id")
    hf_config_path: str | None = _arg(
        None, "the HF config to use instead of the model's: a directory holding a "
              "config.json, or a Hugging Face id (vLLM's)")
    ignore_patterns: list[str] | None = _arg(
        None, "files of a Hugging Face id not to download (glob patterns, vLLM's); "
              "default: original/**/*, the original checkpoint some repositories carry "
              "beside the HF one", nargs="+")
    tokenizer_revision: str | None = _arg(
        None, "branch, tag or commit of the tokenizer's Hugging Face id (the model's own "
              "repository without --tokenizer)")
    hf_token: str | None = _arg(None, "token for the Hugging Face Hub when fetching model "
                                      "ids (default: HF_TOKEN or `hf auth login`'s)")
    download_dir: str | None = _arg(None, "Hugging Face cache directory for model ids "
                                          "(default: the hub's own, HF_HUB_CACHE)")
    trust_remote_code: bool = _arg(False, "let transformers run the model directory's own "
                                          "config, tokenizer and image processor code "
                                          "(auto_map), as vLLM's option does; the model "
                                          "itself always runs pagedllm's implementation of "
                                          "its architecture")
    device: str = _arg("auto", "auto, cpu or cuda (auto picks CUDA when present)",
                       choices=("auto", "cpu", "cuda"))
    dtype: str = _arg("auto", "compute dtype: auto (bfloat16 on CPUs with avx512_bf16 and on "
                              "CUDA, float32 otherwise), float32 (or float), bfloat16, "
                              "float16 (or half); offline also a torch.dtype",
                      choices=_DTYPES + tuple(_DTYPE_ALIASES))
    quantization: str = _arg("auto", "weights of a .gguf file: gguf (run its Q8_0, Q4_0, "
                                     "Q4_1, Q5_0, Q5_1, Q2_K, Q4_K, Q5_K, Q6_K blocks as "
                                     "stored, and Q3_K as Q6_K blocks, through the native "
                                     "quantized GEMM; other types are dequantized), none "
                                     "(dequantize "
                                     "every weight to dtype), auto (gguf on CPUs with "
                                     "AVX512-VNNI or AVX2, the native kernels, one worker "
                                     "and no compile; else none)",
                             choices=_QUANTIZATIONS)
    dequantize: bool = _arg(False, "dequantize GGUF weights to dtype on load (the same as "
                                   "quantization=none)")
    load_format: str = _arg("auto", "how weights are read, as vLLM's: auto (by the path: "
                                    "an HF directory's safetensors, else .bin files; a .gguf "
                                    "file), safetensors, pt (.bin files only), gguf, or "
                                    "dummy (no weights: small random values, for "
                                    "benchmarking a config-only directory)",
                            choices=LOAD_FORMATS)
    max_model_len: int | None = _arg(None, "maximum prompt + output length (default: the "
                                           "model's, capped at 8192)")
    disable_sliding_window: bool = _arg(
        False, "run a sliding-window model as full attention, max_model_len capped at its "
               "smallest window (vLLM's): one KV cache group, the same outputs")
    block_size: int = _arg(16, "tokens per KV cache block")
    kv_cache_space: float | None = _arg(None, "KV cache size in GiB, CPU only (default 4, "
                                              "or env PAGEDLLM_CPU_KVCACHE_SPACE); on CUDA "
                                              "gpu_memory_utilization sizes the cache")
    num_kv_blocks: int | None = _arg(None, "force the number of KV blocks (overrides "
                                           "kv_cache_space and gpu_memory_utilization)",
                                     aliases=("--num-gpu-blocks-override",))
    kv_cache_memory_bytes: int | None = _arg(
        None, "the KV cache's size per worker in bytes, as vLLM's (CPU: instead of "
              "kv_cache_space; CUDA: instead of what gpu_memory_utilization leaves)")
    gpu_memory_utilization: float = _arg(
        0.9, "CUDA only: fraction of the GPU's total memory this engine may use, weights, "
             "activations and KV cache together (the KV cache gets what a profiled "
             "max_num_batched_tokens step leaves; memory of other processes counts "
             "against it)")
    max_num_seqs: int = _arg(256, "maximum number of sequences per step")
    max_num_active_seqs: int | None = _arg(
        None, "most requests running at once, below max_num_seqs (which sizes the "
              "runner's buffers), as vLLM's (default: max_num_seqs)")
    watermark: float = _arg(0.0, "fraction of the KV blocks a request admitted beside "
                                 "running ones must leave free (headroom against "
                                 "preemptions), as vLLM's; 0: none")
    scheduler_reserve_full_isl: bool = _arg(
        True, "admit a request only when the free KV blocks hold its whole prompt besides "
              "the rest of the prompts being prefilled, as vLLM's (stricter: vLLM counts "
              "only the new prompt); off: admit for the blocks of its first chunk, and "
              "long prompts admitted side by side may preempt each other")
    scheduling_policy: str = _arg("fcfs", "fcfs: serve requests in arrival order; priority: "
                                          "by each request's priority (lower first, then "
                                          "arrival), preempting lower-priority ones",
                                  choices=SCHEDULING_POLICIES)
    preemption_mode: str = _arg("recompute", "what preemption does with a running request's "
                                             "KV cache: recompute (drop it, recompute on "
                                             "readmission) or swap (copy it to host memory, "
                                             "see swap_space, and copy it back)",
                                choices=PREEMPTION_MODES)
    swap_space: float = _arg(4.0, "host memory in GiB for swapped-out KV blocks "
                                  "(preemption_mode swap only)")
    kv_cache_dtype: str = _arg("auto", "KV cache storage dtype: auto (the model's dtype), "
                                       "fp8_e4m3 or fp8_e5m2 (one byte per element with "
                                       "per-layer scales: twice the tokens of bfloat16 in the "
                                       "same kv_cache_space; fp8 = fp8_e4m3)",
                               choices=KV_CACHE_DTYPES)
    max_num_batched_tokens: int | None = _arg(None, "token budget per step (default 2048 with "
                                                    "chunked prefill, else max_model_len)")
    max_num_scheduled_tokens: int | None = _arg(
        None, "tokens the scheduler may put in one step, below max_num_batched_tokens "
              "(which sizes the runner), as vLLM's (default: max_num_batched_tokens)")
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of equal prompt prefixes")
    prefix_caching_hash_algo: str = _arg(
        "sha256", "vLLM's: the prefix cache's block hash; pagedllm's is sha256 over its "
                  "own canonical encoding of the tokens (vLLM's sha256_cbor, xxhash and "
                  "xxhash_cbor are not built)", choices=("sha256",))
    enable_chunked_prefill: bool = _arg(True, "split long prompts across steps")
    long_prefill_token_threshold: int | None = _arg(
        None, "most tokens of one prompt a step prefills while other requests are live "
              "(vLLM's option, which caps always): a long prompt then leaves the rest of "
              "each step's budget to the requests behind it, whose first tokens no longer "
              "wait for all of it; alone it is not cut (0: no cap; default: a quarter of "
              "max_num_batched_tokens, at least 256, or with max_num_partial_prefills > 1 "
              "vLLM's 4 percent of max_model_len)")
    max_num_partial_prefills: int = _arg(
        1, "vLLM's: more than 1 sets long_prefill_token_threshold's default to 4 percent "
           "of max_model_len, as vLLM's V1 engine does (prompts prefill side by side in "
           "any case)")
    stream_interval: int = _arg(1, "tokens a stream gathers before its reader is woken "
                                   "(the first token, and the last, go at once): 1 sends "
                                   "every token, a larger value sends fewer, larger events "
                                   "(less front-end work; vLLM's)")
    attention_backend: str | None = _arg(None, "attention backend: torch_ref, cpu or triton "
                                               "(default: cpu on CPU, triton on CUDA; triton "
                                               "runs on CPU under TRITON_INTERPRET=1, slowly)")
    seed: int = _arg(0, "random seed for sampling of requests without their own seed")
    max_logprobs: int = _arg(20, "most logprobs / top_logprobs / prompt_logprobs a request "
                                 "may ask for per position (vLLM's max_logprobs; -1: the "
                                 "whole vocabulary)")
    logprobs_mode: str = _arg(
        "raw_logprobs", "what logprobs and prompt_logprobs report, as vLLM's: "
                        "raw_logprobs (the model's log-softmax), raw_logits, or "
                        "processed_logprobs / processed_logits (after logits processors, "
                        "penalties, temperature, min_p, top-k and top-p: the distribution "
                        "a token was drawn from; prompt tokens have none of those)",
        choices=LOGPROBS_MODES)
    num_threads: int | None = _arg(None, "intra-op threads (default: the physical cores this "
                                         "process may run on, or env PAGEDLLM_NUM_THREADS)")
    compile: bool = _arg(False, "compile the model with torch.compile (inductor; graphs "
                                "cached on disk). Off by default: on CPU the eager path with "
                                "native kernels is as fast and starts in seconds")
    enable_sleep_mode: bool = _arg(
        False, "allow LLM.sleep() / wake_up() (server: POST /sleep and /wake_up, GET "
               "/is_sleeping): an idle engine releases its KV cache (level 1) and its "
               "weights too (level 2: read again from the model's files when woken; on "
               "CUDA, level 1 moves the weights to host memory)")
    profiler_dir: str | None = _arg(
        None, "turn on LLM.start_profile() / stop_profile() (server: POST /start_profile, "
              "/stop_profile): torch profiler traces of the model's steps (Chrome trace "
              "JSON, one per worker) go to this directory (default: env "
              "PAGEDLLM_TORCH_PROFILER_DIR or VLLM_TORCH_PROFILER_DIR; unset: off)")
    profiler_config: dict[str, Any] | None = _arg(
        None, "the torch profiler's options, as vLLM's: a JSON object such as "
              "'{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/tmp/traces\", "
              "\"delay_iterations\": 2, \"max_iterations\": 10}' (also "
              "torch_profiler_with_stack, _record_shapes, _with_memory, _with_flops, "
              "_use_gzip, _dump_cuda_time_total: a table of the ops' total times, "
              "_activities); it turns profiling on as profiler_dir does")
    enforce_eager: bool = _arg(False, "CUDA: run every step eagerly, without capturing CUDA "
                                      "graphs for decode steps")
    optimization_level: int | None = _arg(
        None, "vLLM's -O0..-O3: 0 runs every step eagerly (no CUDA graphs, no compile); "
              "1-3 keep the defaults, pagedllm's optimized path (native kernels, CUDA "
              "graphs of decode steps; torch.compile is --compile's)",
        aliases=("-O",), choices=(0, 1, 2, 3))
    cudagraph_capture_sizes: list[int] | None = _arg(
        None, "vLLM's shortcut for compilation_config's cudagraph_capture_sizes: the decode "
              "batch sizes captured as CUDA graphs", nargs="+")
    max_cudagraph_capture_size: int | None = _arg(
        None, "vLLM's shortcut for compilation_config's max_cudagraph_capture_size: the "
              "largest decode batch captured (larger ones run eagerly; 0: none)")
    compilation_config: dict[str, Any] | None = _arg(
        None, "vLLM's --compilation-config (-cc), as far as it means something here: "
              "cudagraph_capture_sizes (the decode batch sizes captured as CUDA graphs), "
              "max_cudagraph_capture_size, cudagraph_mode NONE (eager) or another "
              "(decode steps captured), mode 0-3 (0: no compile); vLLM's compiler "
              "tuning keys are taken and change nothing", aliases=("-cc",))
    async_scheduling: bool | None = _arg(
        None, "schedule and launch each step while the previous one runs, so the host's "
              "work overlaps the device's (outputs unchanged); default: on for CUDA with "
              "one worker and no speculative decoding, off otherwise")
    tensor_parallel_size: int = _arg(1, "tensor parallel workers: each holds 1/N of every "
                                        "layer's heads and MLP columns and of the vocabulary "
                                        "(CPU: gloo; the threads are shared among them)",
                                    aliases=("-tp",))
    pipeline_parallel_size: int = _arg(1, "pipeline stages: each holds a contiguous range of "
                                          "the layers on its own tensor_parallel_size workers",
                                      aliases=("-pp",))
    logits_processors: list[Any] | None = _arg(
        None, "custom logits processors: subclasses of pagedllm.logits_process."
              "LogitsProcessor, by qualified name (package.module.Class or "
              "package.module:Class; offline also the classes); requests opt in "
              "through SamplingParams.extra_args (the server's vllm_xargs)", nargs="+")
    enable_expert_parallel: bool = _arg(
        False, "mixture-of-experts models (Mixtral, Qwen3-MoE) under tensor parallelism: "
               "each rank holds whole experts, its share of them, instead of a slice of "
               "every expert (vLLM's); attention and dense layers stay tensor parallel",
        aliases=("-ep",))
    expert_placement_strategy: str = _arg(
        "linear", "which experts each rank holds under expert parallelism: linear "
                  "(contiguous ranges) or round_robin (expert e on rank e mod N)",
        choices=EXPERT_PLACEMENT_STRATEGIES)
    data_parallel_size: int = _arg(
        1, "server: replicas of the whole engine, each an engine-core process with its own "
           "scheduler and KV cache (--kv-cache-space each) on its own cores (CPU: the "
           "physical cores split evenly, each replica pinned to its share) or GPU; each "
           "request goes to the least busy replica", aliases=("-dp",))
    distributed_executor_backend: str | None = _arg(
        None, "uni (in-process, one worker), mp (one process per worker on this machine) or "
              "ray (one Ray actor per worker, on any node of a Ray cluster: "
              "pip install pagedllm[ray]); default: uni for one worker, mp for more",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    scheduler_cls: str = _arg(
        "", "a scheduler class of your own (package.module:Class, a subclass of "
            "pagedllm.core.scheduler.Scheduler taking its constructor's arguments), as "
            "vLLM's --scheduler-cls; its names of vLLM's own schedulers mean pagedllm's")
    worker_extension_cls: str = _arg(
        "", "a class (package.module:Class) whose methods every worker gets, for "
            "LLM.collective_rpc to call on every rank (vLLM's; RL frameworks' weight "
            "syncs); its methods see the rank's model_runner, model, device and rank")
    hf_overrides: dict[str, Any] | None = _arg(
        None, "fields set on the model's HF config, as vLLM's: a JSON object such as "
              "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
              "\"classifier_from_token\": [\"no\", \"yes\"]}' (Qwen3-Reranker as a "
              "reranker: its LM head's rows of those tokens become the score head)")
    generation_config: str = _arg(
        "auto", "sampling defaults: auto (the model's generation_config.json: its "
                "temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens "
                "become the defaults of requests that leave them unset, its eos_token_id "
                "list ends generation), vllm (none: SamplingParams' own defaults), or a "
                "directory holding a generation_config.json")
    override_generation_config: dict[str, Any] | None = _arg(
        None, "sampling defaults on top of the generation config, in its names: a JSON "
              "object such as '{\"temperature\": 0.5}'")
    mm_processor_kwargs: dict[str, Any] | None = _arg(
        None, "multimodal models: settings of the image processor over its "
              "preprocessor_config.json's, as vLLM's: a JSON object such as "
              "'{\"do_normalize\": false}' (each one the processor must have; images "
              "must still come out at the vision tower's size)")
    language_model_only: bool = _arg(
        False, "multimodal models: serve the language model alone, as vLLM's: images are "
               "refused and the vision encoder is neither built nor loaded (its memory "
               "saved)")
    limit_mm_per_prompt: dict[str, Any] | None = _arg(
        None, "multimodal models: most images one prompt may hold, as vLLM's: a JSON "
              "object such as '{\"image\": 2}' (default 4)")
    enable_prompt_embeds: bool = _arg(
        False, "let prompts come as input embeddings, as vLLM's option: "
               "LLM.generate({'prompt_embeds': tensor [tokens, hidden_size]}), the "
               "completions API's prompt_embeds (base64 of torch.save); Llama-shaped "
               "models (Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen3-MoE, LLaVA)")
    speculative_config: dict[str, Any] | None = _arg(
        None, "speculative decoding, as vLLM's: a JSON object such as "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (prompt lookup) or "
              "'{\"model\": \"/path/draft\", \"num_speculative_tokens\": 4}' (a draft "
              "model of the same vocabulary); outputs equal those without it")
    spec_method: str | None = _arg(None, "speculative_config's method (vLLM's shortcut): "
                                         "ngram or draft_model")
    spec_model: str | None = _arg(None, "speculative_config's model: the draft model "
                                        "(vLLM's shortcut)")
    spec_tokens: int | None = _arg(None, "speculative_config's num_speculative_tokens "
                                         "(vLLM's shortcut)")
    kv_events_config: dict[str, Any] | None = _arg(
        None, "publish the prefix cache's KV events (blocks stored, removed, cleared) "
              "for a cache-aware router, as vLLM's: a JSON object such as "
              "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
              "\"topic\": \"kv\"}' (ZeroMQ PUB, vLLM's msgpack format; "
              "\"replay_endpoint\" adds a ROUTER socket for missed batches)")
    kv_transfer_config: dict[str, Any] | None = _arg(
        None, "share KV blocks with other engines through a directory, as vLLM's "
              "ExampleConnector: a JSON object such as '{\"kv_connector\": "
              "\"ExampleConnector\", \"kv_role\": \"kv_both\", "
              "\"kv_connector_extra_config\": {\"shared_storage_path\": \"/data/kv\"}}' "
              "(kv_producer saves each prompt block it computes, kv_consumer loads the "
              "blocks it finds: disaggregated prefill, or a prefix cache that outlives "
              "the process); or vLLM's OffloadingConnector (kv_offloading_size)")
    kv_offloading_size: float | None = _arg(
        None, "GiB of host memory (all ranks together) for a second tier of the prefix "
              "cache, as vLLM's: every full block computed is copied there, and a prompt "
              "whose prefix left the KV cache loads it back instead of recomputing it "
              "(vLLM's OffloadingConnector; needs prefix caching)")
    kv_offloading_backend: str = _arg("native", "the tier of kv_offloading_size: native "
                                                "(this process's host memory; vLLM's "
                                                "lmcache is not built)",
                                      choices=("native", "lmcache"))

    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT directories) per request: "
                                    "LLM.generate(lora_request=...), the server's "
                                    "--lora-modules")
    max_loras: int = _arg(1, "most distinct LoRA adapters among the requests running at "
                             "once")
    max_lora_rank: int = _arg(16, "largest LoRA rank r an adapter may have")
    max_cpu_loras: int | None = _arg(None, "LoRA adapters each worker keeps loaded (least "
                                           "recently used dropped first; default: "
                                           "max_loras)")
    lora_dtype: str = _arg(
        "auto", "the adapters' weights, as vLLM's: bfloat16 or float16 rounds them to that "
                "type as they load; auto keeps the file's values (the deltas are computed "
                "in float32 either way)", choices=LORA_DTYPES)
    lora_target_modules: list[str] | None = _arg(
        None, "the linears LoRA adapters may change (vLLM's): names such as o_proj or "
              "q_proj, or a fused qkv_proj / gate_up_proj for its parts; an adapter's "
              "weights for the others are left unused (default: all)", nargs="+")
    reasoning_parser: str | None = _arg(
        None, "the model's reasoning format (<think> ... </think>): deepseek_r1 (DeepSeek-R1, "
              "QwQ: reasoning until </think>) or qwen3 (Qwen3: reasoning when the output "
              "opens with <think>). Structured outputs then constrain only the answer after "
              "the reasoning, and the server's chat replies carry the reasoning in "
              "`reasoning` (and `reasoning_content`)",
        choices=tuple(REASONING_FORMATS))
    guided_decoding_backend: str = _arg(
        "auto", "structured outputs' engine, as vLLM's flag: auto or xgrammar (the one "
                "pagedllm runs; outlines, lm-format-enforcer and guidance are not "
                "available)", choices=_GUIDED_DECODING_BACKENDS)
    enable_mfu_metrics: bool = _arg(
        False, "estimate each step's FLOPs and bytes read and written per worker from the "
               "model's shape (vLLM's model-FLOPs-utilization metrics): Prometheus "
               "counters pagedllm:estimated_flops_per_gpu_total and "
               "estimated_{read,write}_bytes_per_gpu_total, and TFLOP/s and GB/s in the "
               "stats log line")
    enable_logging_iteration_details: bool = _arg(
        False, "log a line per engine step (vLLM's): its prefill and decode requests and "
               "tokens, and the milliseconds from scheduling it to its output")
    kv_cache_metrics: bool = _arg(False, "measure how long a sample of KV blocks stay "
                                         "(lifetime, idle time before eviction, reuse "
                                         "gaps: /metrics histograms), as vLLM's")
    kv_cache_metrics_sample: float = _arg(0.01, "the fraction of blocks kv_cache_metrics "
                                                "follows, in (0, 1]")
    custom_histogram_buckets: dict[str, Any] | None = _arg(
        None, "bucket bounds replacing a histogram family's defaults, as vLLM's: a JSON "
              "object such as '{\"time_to_first_token\": [0.05, 0.1, 0.5, 1, 5]}' "
              "(families request_latency, time_to_first_token, inter_token_latency, "
              "kv_cache_residency, and vLLM's others, taken)")
    structured_outputs_config: dict[str, Any] | None = _arg(
        None, "vLLM's structured outputs options as a JSON object: backend (auto | "
              "xgrammar), disable_any_whitespace (every JSON grammar compact), "
              "reasoning_parser (as --reasoning-parser); vLLM's guidance-only "
              "disable_additional_properties, reasoning_parser_plugin and "
              "enable_in_reasoning are refused by name")
    reasoning_config: dict[str, Any] | None = _arg(
        None, "vLLM's reasoning options as a JSON object: reasoning_parser (as "
              "--reasoning-parser), reasoning_start_str (the parser's start tag: no "
              "other is read) and reasoning_end_str (what a spent thinking_token_budget "
              "forces, token by token: a phrase ending with the end tag, such as "
              "\"Time is up.</think>\"; default: the end tag)")
    grammar_compile_timeout: float = _arg(
        60.0, "CPU seconds the grammar of one structured-output request may take to "
              "compile; past it the compile is killed and the request fails as invalid "
              "(0: no limit)")
    grammar_compile_memory: float = _arg(
        4.0, "GiB of memory the grammar compiler may hold while compiling one request's "
             "grammar; past it the compile is killed and the request fails as invalid "
             "(0: no limit; with both limits 0 grammars compile in the engine process)")

    def _resolve_runner(self, model: ModelConfig) -> str:
        """ModelConfig.runner of `runner` (or the older `task`): refused when the model
        cannot do it."""
        runner = self.runner
        if runner not in _RUNNERS:
            raise ConfigError(f"runner must be one of {_RUNNERS}, got {runner!r}")
        if self.convert in ("embed", "classify"):
            if runner == "generate":
                raise ConfigError(f"convert {self.convert!r} makes a pooling model: "
                                  f"runner 'generate' disagrees")
            if self.convert == "embed" and model.pooling_task != "embed":
                raise ConfigError(f"convert 'embed': {model.architecture} does "
                                  f"{model.pooling_task!r}, not embeddings")
            runner = "pooling"
        if self.task is not None:
            if self.task not in _TASK_RUNNERS:
                raise ConfigError(f"task must be one of {tuple(_TASK_RUNNERS)}, got "
                                  f"{self.task!r}")
            if runner not in ("auto", _TASK_RUNNERS[self.task]):
                raise ConfigError(f"task {self.task!r} and runner {runner!r} disagree")
            runner = _TASK_RUNNERS[self.task]
        if runner == "generate" and not model.can_generate:
            raise ConfigError(f"runner 'generate': {model.architecture} cannot generate (an "
                              f"encoder or a classifier); use runner 'pooling' or 'auto'")
        return runner

    def _structured_outputs_options(self) -> tuple[str, str | None, bool]:
        """(backend, reasoning parser, disable_any_whitespace): the flags, with
        structured_outputs_config's fields over them."""
        if self.structured_outputs_config is None:
            return self.guided_decoding_backend, self.reasoning_parser, False
        require_json_object("structured_outputs_config", self.structured_outputs_config)
        values = dict(self.structured_outputs_config)
        known = {"backend", "disable_any_whitespace", "disable_additional_properties",
                 "reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning"}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(f"unknown structured_outputs_config keys {sorted(unknown)}; "
                              f"valid: {sorted(known)}")
        for name, why in (("disable_additional_properties", "a guidance backend option"),
                          ("reasoning_parser_plugin", "reasoning parser plugins"),
                          ("enable_in_reasoning", "grammars inside the reasoning")):
            if values.get(name):
                raise ConfigError(f"structured_outputs_config {name}: {why} is not "
                                  f"supported by pagedllm")
        reasoning_parser = _agreeing_parser("structured_outputs_config", values,
                                            self.reasoning_parser)
        flag = values.get("disable_any_whitespace", False)
        if not isinstance(flag, bool):
            raise ConfigError(f"structured_outputs_config disable_any_whitespace must be "
                              f"true or false, got {flag!r}")
        return values.get("backend", self.guided_decoding_backend), reasoning_parser, flag

    def _reasoning_options(self, reasoning_parser: str | None,
                           ) -> tuple[str | None, str | None]:
        """(reasoning parser, the forced end string) with reasoning_config's fields."""
        if self.reasoning_config is None:
            return reasoning_parser, None
        require_json_object("reasoning_config", self.reasoning_config)
        values = dict(self.reasoning_config)
        known = {"reasoning_parser", "reasoning_start_str", "reasoning_end_str"}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(f"unknown reasoning_config keys {sorted(unknown)}; valid: "
                              f"{sorted(known)}")
        for name in known:
            if values.get(name) is not None and not isinstance(values[name], str):
                raise ConfigError(f"reasoning_config {name} must be a string, "
                                  f"got {values[name]!r}")
        reasoning_parser = _agreeing_parser("reasoning_config", values, reasoning_parser)
        start = values.get("reasoning_start_str")
        if start and (reasoning_parser is None
                      or start != get_reasoning_format(reasoning_parser).start):
            raise ConfigError(f"reasoning_config reasoning_start_str {start!r}: only the "
                              f"reasoning parser's own start tag is read")
        return reasoning_parser, values.get("reasoning_end_str") or None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def create_engine_config(self) -> EngineConfig:
        """Resolve defaults (model path, device, dtype, lengths) into an `EngineConfig`."""
        # loader/ imports torch: only here, so `import pagedllm` (and core/) stays light.
        from pagedllm.loader.hf_config import load_hf_config

        backend, reasoning_parser, compact_json = self._structured_outputs_options()
        reasoning_parser, reasoning_end = self._reasoning_options(reasoning_parser)
        if backend not in _GUIDED_DECODING_BACKENDS:
            raise ConfigError(f"guided_decoding_backend must be one of "
                              f"{_GUIDED_DECODING_BACKENDS} (pagedllm's structured outputs "
                              f"run on xgrammar), got {backend!r}")
        for name, allowed in (("config_format", _CONFIG_FORMATS),
                              ("model_impl", _MODEL_IMPLS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed} (pagedllm reads HF "
                                  f"configs into its own model implementations), got "
                                  f"{getattr(self, name)!r}")
        if self.tokenizer_mode not in _TOKENIZER_MODES:
            raise ConfigError(f"tokenizer_mode must be one of {_TOKENIZER_MODES} (transformers' "
                              f"tokenizer), got {self.tokenizer_mode!r}")
        path = self._resolve_model_path()
        tokenizer = self._resolve_tokenizer()
        config_path = (self._resolve_path(self.hf_config_path, weights=False)
                       if self.hf_config_path is not None else path)
        hf_config = apply_hf_overrides(load_hf_config(config_path, self.trust_remote_code),
                                       self.hf_overrides, tokenizer or path,
                                       self.trust_remote_code)
        converted = converted_architecture(hf_config, self.convert)
        if converted is not None:
            hf_config.architectures = [converted]
        device = _resolve_device(self.device)
        dtype = _resolve_dtype(self.dtype, device, hf_config)
        max_model_len = _resolve_max_model_len(self.max_model_len, hf_config)
        if self.disable_sliding_window:
            max_model_len = _cap_at_window(max_model_len, hf_config)
        model = ModelConfig(path=path, hf_config=hf_config, dtype=dtype,
                            max_model_len=max_model_len, tokenizer=tokenizer,
                            seed=self.seed, max_logprobs=self.max_logprobs,
                            logprobs_mode=self.logprobs_mode,
                            quantization=self._resolve_quantization(path, device, dtype),
                            trust_remote_code=self.trust_remote_code,
                            load_format=self.load_format)
        _set_embedding_traits(model, self.compile)
        model.runner = self._resolve_runner(model)
        model.pooler = pooler_config(self.pooler_config, model)
        model.default_pooling_type = model.pooler.pooling_type or model.default_pooling_type
        self._multimodal_traits(model)
        self._generation_defaults(model)
        space = self.kv_cache_space
        if space is None:
            space = env_kv_cache_space()
        elif (device == "cuda" and self.num_kv_blocks is None
              and self.kv_cache_memory_bytes is None):
            logger.warning("kv_cache_space is ignored on CUDA: gpu_memory_utilization "
                           "(%s) sizes the KV cache; num_kv_blocks forces a block count",
                           self.gpu_memory_utilization)
        cache = CacheConfig(block_size=self.block_size, kv_cache_space=space,
                            num_kv_blocks=self.num_kv_blocks,
                            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            # An encoder's prompt is recomputed whole: a bidirectional
                            # layer needs every position, and it keeps no KV to reuse.
                            enable_prefix_caching=(self.enable_prefix_caching
                                                   and not model.is_encoder_only),
                            swap_space=self.swap_space, cache_dtype=self.kv_cache_dtype)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        sched = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=max_model_len,
                                max_num_scheduled_tokens=self.max_num_scheduled_tokens,
                                scheduler_cls=self.scheduler_cls,
                                max_num_active_seqs=self.max_num_active_seqs,
                                watermark=self.watermark,
                                reserve_full_prompt=self.scheduler_reserve_full_isl,
                                enable_chunked_prefill=self.enable_chunked_prefill,
                                policy=self.scheduling_policy,
                                preemption_mode=self.preemption_mode,
                                attention_pairs_per_token=_attention_pairs_per_token(
                                    hf_config, model.quantization == "gguf"),
                                prompt_logprob_cost=_prompt_logprob_cost(
                                    hf_config, model.quantization == "gguf"),
                                long_prefill_token_threshold=self._long_prefill_threshold(
                                    max_model_len, budget),
                                stream_interval=self.stream_interval)
        backend = self.attention_backend or ("cpu" if device == "cpu" else "triton")
        graphs = resolve_graphs(self.enforce_eager, self.compile, self.optimization_level,
                                self._compilation_config())
        device_config = DeviceConfig(
            device=device, attention_backend=backend,
            num_threads=_resolve_num_threads(self.num_threads), compile=self.compile,
            compile_cache_dir=str(cache_root() / "inductor"),
            enforce_eager=graphs.enforce_eager, cuda_graph_sizes=graphs.cuda_graph_sizes,
            max_cuda_graph_size=graphs.max_cuda_graph_size,
            enable_sleep_mode=self.enable_sleep_mode)
        profiler_dir, device_config.profiler = profiler_options(
            self.profiler_config, _resolve_profiler_dir(self.profiler_dir))
        device_config.profiler_dir = _resolve_profiler_dir(profiler_dir)
        parallel = self._parallel_config(hf_config, device)
        speculative = self._speculative_config(parallel, model, device)
        self._prompt_embeds(model, speculative)
        sched.async_scheduling = self._resolve_async_scheduling(parallel, speculative,
                                                                device)
        structured_outputs = StructuredOutputsConfig(
            compile_timeout_s=self.grammar_compile_timeout,
            compile_memory_gib=self.grammar_compile_memory,
            reasoning_parser=reasoning_parser, disable_any_whitespace=compact_json,
            reasoning_end_str=reasoning_end)
        lora = self._lora_config(parallel, model)
        logits_processors = self._logits_processors(speculative)
        sched.max_loras = lora.max_loras if lora is not None else None
        return EngineConfig(model=model, cache=cache, scheduler=sched, device=device_config,
                            parallel=parallel, speculative=speculative,
                            structured_outputs=structured_outputs, lora=lora,
                            logits_processors=logits_processors,
                            kv_events=self._kv_events_config(cache),
                            kv_transfer=self._kv_transfer_config(cache, parallel,
                                                                 speculative),
                            observability=self._observability_config())

    def _kv_events_config(self, cache: CacheConfig) -> KVEventsConfig | None:
        if self.kv_events_config is None:
            return None
        require_json_object("kv_events_config", self.kv_events_config)
        config = KVEventsConfig.from_dict(self.kv_events_config)
        if not config.enable_kv_cache_events:
            return None
        if not cache.enable_prefix_caching:
            raise ConfigError("KV cache events (kv_events_config) describe the prefix "
                              "cache: they need enable_prefix_caching")
        return config

    def _observability_config(self) -> ObservabilityConfig:
        if not self.kv_cache_metrics and self.kv_cache_metrics_sample != 0.01:
            raise ConfigError("kv_cache_metrics_sample needs kv_cache_metrics")
        if self.kv_cache_metrics and not 0 < self.kv_cache_metrics_sample <= 1:
            raise ConfigError(f"kv_cache_metrics_sample must be in (0, 1], got "
                              f"{self.kv_cache_metrics_sample!r}")
        buckets = self.custom_histogram_buckets
        if buckets is not None:
            require_json_object("custom_histogram_buckets", buckets)
        return ObservabilityConfig(
            kv_cache_metrics_sample=self.kv_cache_metrics_sample if self.kv_cache_metrics
            else 0.0, histogram_buckets=dict(buckets or {}),
            enable_mfu_metrics=self.enable_mfu_metrics,
            enable_logging_iteration_details=self.enable_logging_iteration_details)

    def _kv_transfer_config(self, cache: CacheConfig, parallel: ParallelConfig,
                            speculative: SpeculativeConfig | None,
                            ) -> KVTransferConfig | None:
        values = self.kv_transfer_config
        if self.kv_offloading_size is not None:
            values = self._offloading_config()
        if values is None:
            return None
        require_json_object("kv_transfer_config", values)
        config = KVTransferConfig.from_dict(values)
        offloading = config.is_offloading
        refused = [what for what, used in (
            ("enable_prefix_caching off (stored blocks are found by their prefix-cache "
             "hashes)", not cache.enable_prefix_caching),
            # (The host tier copies every rank's own layers and the draft's K/V too.)
            ("pipeline parallelism", parallel.pipeline_parallel_size > 1 and not offloading),
            ("a draft model (its K/V is not stored)",
             speculative is not None and speculative.method == "draft_model"
             and not offloading)) if used]
        if refused:
            raise ConfigError(f"{'kv_offloading_size' if offloading else 'kv_transfer_config'}"
                              f" does not work with {refused[0]}")
        if offloading:
            import psutil

            # Its pages are mapped as blocks arrive: too large a tier would start, then
            # be killed once it filled.
            total = psutil.virtual_memory().total
            if config.offload_bytes > total:
                raise ConfigError(f"kv_offloading_size: {config.offload_bytes / (1 << 30):.1f}"
                                  f" GiB is more than this machine's memory "
                                  f"({total / (1 << 30):.1f} GiB)")
        return config

    def _compilation_config(self) -> Any:
        """compilation_config with vLLM's shortcut flags in it (each excludes its key)."""
        cc = self.compilation_config
        shortcuts = {k: v for k, v in (
            ("cudagraph_capture_sizes", self.cudagraph_capture_sizes),
            ("max_cudagraph_capture_size", self.max_cudagraph_capture_size)) if v is not None}
        if not shortcuts:
            return cc
        cc = {} if cc is None else cc
        if not isinstance(cc, dict):
            raise ConfigError(f"compilation_config must be a JSON object, got {cc!r}")
        both = sorted(set(shortcuts) & set(cc))
        if both:
            raise ConfigError(f"{both[0]} and compilation_config's {both[0]} are mutually "
                              f"exclusive: give one")
        return cc | {k: list(v) if isinstance(v, list | tuple) else v
                     for k, v in shortcuts.items()}

    def _offloading_config(self) -> dict[str, Any]:
        """vLLM's translation of kv_offloading_size into kv_transfer_config."""
        size = self.kv_offloading_size
        if self.kv_transfer_config is not None:
            raise ConfigError("kv_offloading_size and kv_transfer_config together are not "
                              "supported (vLLM's MultiConnector is not built): give one")
        if self.kv_offloading_backend != "native":
            raise ConfigError(f"kv_offloading_backend {self.kv_offloading_backend!r} is not "
                              f"built; the native backend is")
        if isinstance(size, bool) or not isinstance(size, int | float) or not size > 0:
            raise ConfigError(f"kv_offloading_size must be a number of GiB > 0, got "
                              f"{size!r}")
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": int(size * (1 << 30))}}

    def _logits_processors(self, speculative: SpeculativeConfig | None,
                           ) -> tuple[type, ...]:
        """The processors' classes (async scheduling is refused with them by
        _resolve_async_scheduling)."""
        from pagedllm.logits_process import resolve_logits_processors

        classes = resolve_logits_processors(self.logits_processors)
        if classes and speculative is not None:
            raise ConfigError("logits_processors with speculative decoding are not "
                              "supported (a processor reads each position's tokens)")
        return classes

    def _lora_config(self, parallel: ParallelConfig, model: ModelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        reasons = [why for why, applies in (
            ("compile=True", self.compile),
            ("an encoder-only model", model.is_encoder_only)) if applies]
        if reasons:
            raise ConfigError(f"enable_lora is not supported with {reasons[0]}")
        from pagedllm.lora.adapter import FUSED_TARGETS, lora_targets

        # Raises for an architecture without LoRA support.
        known = set(lora_targets(model.hf_config)) | set(FUSED_TARGETS)
        targets = self.lora_target_modules
        if targets is not None:
            unknown = [t for t in targets if t not in known]
            if unknown or not targets:
                raise ConfigError(f"lora_target_modules: {unknown[0] if unknown else '[]'} "
                                  f"is not a linear LoRA can adapt here; choose from "
                                  f"{', '.join(sorted(known))}")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, lora_dtype=self.lora_dtype,
                          target_modules=tuple(targets) if targets is not None else None)

    def _resolve_async_scheduling(self, parallel: ParallelConfig,
                                  speculative: SpeculativeConfig | None, device: str) -> bool:
        """Explicit True where it works, else an error naming why; None: on where it pays
        (CUDA, where the host's step work can overlap the device's)."""
        reasons = [why for why, applies in (
            ("speculative decoding (a step's proposals need its sampled tokens on the "
             "host)", speculative is not None),
            ("more than one worker", parallel.world_size > 1),
            ("logits processors (they read each request's latest token on the host)",
             bool(self.logits_processors))) if applies]
        if self.async_scheduling is None:
            return device == "cuda" and not reasons
        if self.async_scheduling and reasons:
            raise ConfigError(f"async_scheduling is not supported with {reasons[0]}")
        return bool(self.async_scheduling)

    def _generation_defaults(self, model: ModelConfig) -> None:
        """ModelConfig's sampling defaults and extra EOS ids from the generation config."""
        from pagedllm.loader.generation_config import (load_generation_config,
                                                       override_sampling_defaults)

        source = self.generation_config
        defaults: dict[str, Any] = {}
        if source == "auto":
            if not model.is_gguf:
                defaults, model.generation_eos_token_ids = load_generation_config(model.path)
        elif source != "vllm":
            if not os.path.isdir(source):
                raise ConfigError(f"generation_config must be auto, vllm or a directory, "
                                  f"got {source!r}")
            defaults, model.generation_eos_token_ids = load_generation_config(source)
        model.sampling_defaults = override_sampling_defaults(
            defaults, self.override_generation_config)
        if model.sampling_defaults:
            logger.info("default sampling parameters from the generation config: %s "
                        "(--generation-config vllm for none)", model.sampling_defaults)

    def _multimodal_traits(self, model: ModelConfig) -> None:
        """The image limit; what a model with images does not run with yet."""
        limit = self.limit_mm_per_prompt
        if limit is not None:
            if not isinstance(limit, dict) or set(limit) - {"image"}:
                raise ConfigError(f"limit_mm_per_prompt must be a dict such as "
                                  f"{{'image': 2}}, got {limit!r}")
            model.max_images_per_prompt = limit.get("image", model.max_images_per_prompt)
            model.__post_init__()  # checks the limit
        if self.mm_processor_kwargs is not None:
            require_json_object("mm_processor_kwargs", self.mm_processor_kwargs)
            model.mm_processor_kwargs = self.mm_processor_kwargs
        if model.image_token_id is None:
            return
        if self.language_model_only:
            model.language_model_only, model.max_images_per_prompt = True, 0
        refused = [what for what, used in (
            ("compile", self.compile),
            ("a GGUF file", model.is_gguf),
            ("a draft model", self.spec_model is not None
             or isinstance(self.speculative_config, dict)
             and "model" in self.speculative_config)) if used]
        if refused:
            raise ConfigError(f"{model.architecture} (a model with images) does not run "
                              f"with {refused[0]} yet")

    def _long_prefill_threshold(self, max_model_len: int, budget: int) -> int:
        """long_prefill_token_threshold; by default a quarter of the step's budget, at
        least 256 (without chunked prefill none), or vLLM's 4% of max_model_len with
        max_num_partial_prefills > 1."""
        if not isinstance(self.max_num_partial_prefills, int) \
                or self.max_num_partial_prefills < 1:
            raise ConfigError(f"max_num_partial_prefills must be >= 1, got "
                              f"{self.max_num_partial_prefills!r}")
        if self.long_prefill_token_threshold is not None:
            return self.long_prefill_token_threshold
        if not self.enable_chunked_prefill:
            return 0
        if self.max_num_partial_prefills > 1:
            return max(1, int(max_model_len * 0.04))
        # A quarter: a step behind a long prompt admits short ones with 3/4 of the
        # budget, and the long prompt's chunks stay large enough to run at full speed
        # (256 tokens at least: smaller GEMMs lose speed).
        return max(budget // 4, min(budget, 256))

    def _prompt_embeds(self, model: ModelConfig,
                       speculative: SpeculativeConfig | None) -> None:
        """enable_prompt_embeds: where the model and the options allow it."""
        if not self.enable_prompt_embeds:
            return
        from pagedllm.models.registry import prompt_embeds_architectures

        if model.architecture not in prompt_embeds_architectures():
            raise ConfigError(f"enable_prompt_embeds: {model.architecture} does not take "
                              f"input embeddings (these do: "
                              f"{', '.join(prompt_embeds_architectures())})")
        refused = [what for what, used in (
            ("compile", self.compile),
            ("speculative decoding (its proposers read the prompt's tokens)",
             speculative is not None),
            ("the pooling runner (embedding requests take token prompts)",
             model.runner == "pooling")) if used]
        if refused:
            raise ConfigError(f"enable_prompt_embeds does not work with {refused[0]}")
        model.enable_prompt_embeds = True

    def _speculative_config(self, parallel: ParallelConfig, target: ModelConfig,
                            device: str) -> SpeculativeConfig | None:
        if self.speculative_config is not None:
            require_json_object("speculative_config", self.speculative_config)
        # vLLM's shortcut flags fill in (and override) the object's fields.
        shortcuts = {key: value for key, value in (
            ("method", self.spec_method), ("model", self.spec_model),
            ("num_speculative_tokens", self.spec_tokens)) if value is not None}
        values = (self.speculative_config or {}) | shortcuts
        if not values:
            return None
        spec = SpeculativeConfig.from_dict(values)
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("speculative decoding with pipeline parallelism is not "
                              "supported (the stages overlap steps; a step's proposals "
                              "would arrive a step late)")
        if self.compile:
            raise ConfigError("speculative decoding with compile=True is not supported")
        if spec.method == "draft_model" and parallel.world_size > 1:
            raise ConfigError("a draft model with tensor parallelism is not supported yet "
                              "(prompt lookup, method 'ngram', is)")
        if spec.model is not None:
            from pagedllm.loader.hf_config import load_hf_config

            spec.model = self._resolve_path(spec.model, revision=None)
            hf_config = load_hf_config(spec.model, self.trust_remote_code)
            if hf_config.vocab_size != target.hf_config.vocab_size:
                raise ConfigError(f"the draft model's vocabulary ({hf_config.vocab_size} "
                                  f"tokens) differs from the model's "
                                  f"({target.hf_config.vocab_size})")
            spec.draft = ModelConfig(path=spec.model, hf_config=hf_config,
                                     dtype=target.dtype, max_model_len=target.max_model_len,
                                     seed=self.seed,
                                     quantization=self._resolve_quantization(
                                         spec.model, device, target.dtype))
        return spec

    def _resolve_quantization(self, path: str, device: str, dtype: str) -> str | None:
        """ModelConfig.quantization: "gguf" where asked for or (auto) where it runs."""
        if self.quantization not in _QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {_QUANTIZATIONS}, "
                              f"got {self.quantization!r}")
        if self.dequantize and self.quantization == "gguf":
            raise ConfigError("dequantize=True contradicts quantization='gguf'")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, "
                              f"got {self.load_format!r}")
        if self.load_format == "dummy":
            if self.quantization == "gguf":
                raise ConfigError("load_format='dummy' reads no GGUF blocks to run: "
                                  "quantization='gguf' needs the file's weights")
            return None
        if self.dequantize or self.quantization == "none" or not path.endswith(".gguf"):
            return "gguf" if self.quantization == "gguf" else None  # ModelConfig checks
        from pagedllm.kernels.cpu.build import load_cpu_kernels

        why = None
        if device != "cpu":
            why = f"the device is {device} (the quantized GEMM is a CPU kernel)"
        elif self.compile:
            why = "compile=True (compiled graphs run dense weights)"
        elif dtype not in ("bfloat16", "float32"):
            why = f"dtype {dtype} (the quantized GEMM takes bfloat16 or float32 activations)"
        elif not load_cpu_kernels():
            why = "the native CPU kernels are unavailable"
        if why is not None and self.quantization == "gguf":
            raise ConfigError(f"quantization='gguf' cannot run here: {why}")
        if why is None and (self.quantization == "gguf" or has_quant_simd()):
            return "gguf"
        # auto only: without AVX2 the kernel's portable path is many times slower than the
        # dequantized one (quantization='gguf' still runs it).
        why = why or "the CPU lacks AVX2 / AVX512-VNNI (the quantized GEMM would be slow)"
        logger.info("GGUF weights are dequantized on load (quantization=none): %s", why)
        return None

    def _parallel_config(self, hf_config: Any, device: str) -> ParallelConfig:
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            data_parallel_size=self.data_parallel_size,
            worker_extension_cls=self.worker_extension_cls,
            enable_expert_parallel=self.enable_expert_parallel,
            expert_placement_strategy=self.expert_placement_strategy)
        parallel.verify_with_model(hf_config)
        if self.scheduler_cls:  # a ConfigError now, not in the engine core's process
            from pagedllm.engine.engine_core import scheduler_class

            scheduler_class(self.scheduler_cls)
        if self.worker_extension_cls:
            from pagedllm.worker.rpc import extension_class

            extension_class(self.worker_extension_cls)  # a ConfigError now, not on a rank
        if parallel.world_size > 1 and self.compile:
            raise ConfigError("compile=True with tensor_parallel_size > 1 is not supported "
                              "yet (the compiled graph has no collectives)")
        if parallel.world_size > 1 and device != "cpu":
            raise ConfigError("tensor parallelism runs on CPU (gloo) only so far; "
                              "NCCL on CUDA is not implemented yet")
        if parallel.data_parallel_size > 1:
            from pagedllm.engine.dp_placement import check_placement

            check_placement(parallel, device)
        return parallel

    def _resolve_model_path(self) -> str:
        if self.model is None:
            return default_model_path()
        return self._resolve_path(self.model)

    def _resolve_path(self, model: str, revision: str | None | bool = True,
                      weights: bool = True) -> str:
        """A local path (made absolute) or a Hugging Face id (resolved to its snapshot at
        `revision`, True: the model's --revision; without `weights`: the tokenizer's
        files only)."""
        path = os.path.expanduser(model)
        if os.path.exists(path):
            return os.path.abspath(path)
        from pagedllm.loader.hub import looks_like_repo_id, resolve_repo_id

        if looks_like_repo_id(model):
            return resolve_repo_id(model, self.revision if revision is True else revision,
                                   self.download_dir, token=self.hf_token, weights=weights,
                                   code=self.trust_remote_code,
                                   ignore_patterns=(DEFAULT_IGNORE_PATTERNS
                                                    if self.ignore_patterns is None
                                                    else self.ignore_patterns))
        what = "model" if weights else "tokenizer"
        raise ModelLoadError(f"{what} path does not exist: {model!r} (pass an HF model "
                             f"directory, a .gguf file or a Hugging Face id org/name)")

    def _resolve_tokenizer(self) -> str | None:
        """The tokenizer's own directory (None: the model's): --tokenizer, or the model's
        repository at --tokenizer-revision."""
        if self.tokenizer is not None:
            return self._resolve_path(self.tokenizer, self.tokenizer_revision, weights=False)
        if self.tokenizer_revision is None:
            return None
        from pagedllm.loader.hub import looks_like_repo_id

        if (self.model is None or os.path.exists(os.path.expanduser(self.model))
                or not looks_like_repo_id(self.model)):
            raise ConfigError("tokenizer_revision names a revision of a Hugging Face id: "
                              "give the model (or --tokenizer) as org/name")
        return self._resolve_path(self.model, self.tokenizer_revision, weights=False)


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any] | None,
                       tokenizer_path: str, trust_remote_code: bool = False) -> Any:
    """The HF config with `overrides` set on it (vLLM's hf_overrides). With
    `classifier_from_token` (a causal LM read as a sequence classifier from its LM
    head's rows of those tokens) the tokens' ids (`classifier_token_ids`, from the
    model's tokenizer) and the labels: one for two tokens (the second's logit minus the
    first's: a 2-way softmax as a sigmoid), else one per token."""
    if not overrides:
        return hf_config
    require_json_object("hf_overrides", overrides)
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    tokens = overrides.get("classifier_from_token")
    if tokens is not None:
        if (not isinstance(tokens, list) or len(tokens) < 2
                or not all(isinstance(t, str) for t in tokens)):
            raise ConfigError(f"classifier_from_token must list two or more tokens, got "
                              f"{tokens!r}")
        from pagedllm.loader import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
        unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
        if unknown:
            raise ConfigError(f"classifier_from_token: {unknown[0]!r} is not one token of "
                              f"the model's vocabulary")
        hf_config.classifier_token_ids = ids
        hf_config.num_labels = 1 if len(ids) == 2 else len(ids)
    return hf_config


def _agreeing_parser(option: str, values: dict[str, Any], parser: str | None) -> str | None:
    """The reasoning parser once `option`'s reasoning_parser (if any) is taken: it must
    agree with the one already chosen (--reasoning-parser)."""
    given = values.get("reasoning_parser")
    if not given:
        return parser
    if parser not in (None, given):
        raise ConfigError(f"{option} reasoning_parser {given!r} and --reasoning-parser "
                          f"{parser!r} disagree")
    return given


def _set_embedding_traits(model: ModelConfig, compile: bool) -> None:
    """Whether the model is an encoder, and its default pooling (the model directory's
    sentence-transformers Pooling config, else mean for encoders, last for decoders;
    vLLM falls back to CLS for BERT instead, sentence-transformers to mean)."""
    from pagedllm.loader.st_config import load_st_pooling_type
    from pagedllm.models.registry import is_encoder_only, is_sequence_classifier

    model.is_encoder_only = is_encoder_only(model.architecture)
    if model.is_encoder_only and compile:
        raise ConfigError(f"compile is not supported for the encoder model "
                          f"{model.architecture} (its attention runs eagerly per request)")
    if is_sequence_classifier(model.architecture):
        one_label = getattr(model.hf_config, "num_labels", 1) == 1
        model.pooling_task = "score" if one_label else "classify"
        # What the classification head reads: an encoder's [CLS], a decoder's last token.
        model.default_pooling_type = "cls" if model.is_encoder_only else "last"
        return
    fallback = "mean" if model.is_encoder_only else "last"
    model.default_pooling_type = load_st_pooling_type(model.path) or fallback


def _attention_pairs_per_token(hf_config: Any, native_quantized: bool = False) -> int:
    """SchedulerConfig.attention_pairs_per_token of a model: a token's linear layers take
    ~2 (4 h^2 + 3 h i) FLOPs per layer (attention projections, a gated MLP of i, times
    the experts each token uses), one query-key pair ~4 h (scores and values), so one
    token costs about 2 h + 1.5 i pairs.

    That holds where both run at one rate: the bundled SmolLM2 dequantized to bfloat16
    on CPU, whose 8,000-token prompt then goes in steps of 2.2-2.4 s each. Native GGUF
    weights (int8 activations, kernels/cpu) run the linear layers ~3x faster than its
    attention: their steps grew from 1.3 to 2.1 s until the ratio was divided by 3
    (then 1.2-1.3 s each)."""
    hidden, inner = _layer_widths(hf_config)
    return int((2 * hidden + 1.5 * inner) / (3 if native_quantized else 1))


def _prompt_logprob_cost(hf_config: Any, native_quantized: bool = False) -> float:
    """SchedulerConfig.prompt_logprob_cost of a model: a row of logits takes h V
    multiply-adds, a token's linear layers ~L (4 h^2 + 3 h i), so V / (L (4 h + 3 i)),
    and 3x that with native GGUF weights, as in _attention_pairs_per_token (their
    layers' int8 kernels outrun the head: its wide, shallow GEMM writes a row of V
    logits per token). SmolLM2: 0.24 and 0.71; measured in the engine (2,000-token
    prompts, prompt_logprobs 20: the head and the native scoring against the forward,
    in these units): 0.72 with the bundled Q4_1 file, 0.35 dequantized to bfloat16."""
    hidden, inner = _layer_widths(hf_config)
    layers = next((v for name in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(v := getattr(hf_config, name, None), int)), 0)
    vocab = getattr(hf_config, "vocab_size", None)
    if not (hidden and layers and isinstance(vocab, int)):
        return 0.0
    return vocab / (layers * (4 * hidden + 3 * inner)) * (3 if native_quantized else 1)


def _layer_widths(hf_config: Any) -> tuple[int, int]:
    """(hidden size, the MLP width each token goes through: its experts' together)."""
    hidden = next((v for name in ("hidden_size", "n_embd", "d_model")
                   if isinstance(v := getattr(hf_config, name, None), int)), 0)
    inner = next((v for name in ("intermediate_size", "ffn_dim", "n_inner")
                  if isinstance(v := getattr(hf_config, name, None), int)), 4 * hidden)
    return hidden, inner * (getattr(hf_config, "num_experts_per_tok", None) or 1)


def _resolve_profiler_dir(requested: str | None) -> str | None:
    path = requested or env_profiler_dir()
    return os.path.abspath(os.path.expanduser(path)) if path else None


def _resolve_num_threads(requested: int | None) -> int:
    """Threads for torch's intra-op pool: one per physical core this process may use
    (hyper-threads share a core's vector units and only add contention)."""
    if requested is None:
        requested = env_num_threads()
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"num_threads must be >= 1, got {requested}")
        return requested
    import psutil

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    physical = psutil.cpu_count(logical=False) or psutil.cpu_count() or 1
    logical = psutil.cpu_count() or physical
    if allowed is None or allowed >= logical:
        return physical
    # A restricted affinity mask: assume it spans hyper-thread siblings evenly.
    return max(1, allowed * physical // logical)


def _resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {device!r}")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        build = "this torch is a CPU-only build" if torch.version.cuda is None else \
            "torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES?)"
        raise ConfigError(f"device 'cuda' was requested but no CUDA GPU is available: "
                          f"{build}. Use device 'cpu' or 'auto'.")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(dtype: Any, device: str, hf_config: Any) -> str:
    import torch

    if isinstance(dtype, torch.dtype):  # LLM(dtype=torch.bfloat16), as vLLM takes it
        dtype = str(dtype).removeprefix("torch.")
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {_DTYPES + tuple(_DTYPE_ALIASES)}, got "
                          f"{dtype!r}")
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if has_avx512_bf16() else "float32"


def _cap_at_window(max_model_len: int, hf_config: Any) -> int:
    """disable_sliding_window: max_model_len within the model's smallest sliding window,
    where a window layer sees every position (its KV group is then full attention,
    core/kv_groups.py); unchanged for a model without windows."""
    from pagedllm.models.registry import get_model_class

    architecture = (getattr(hf_config, "architectures", None) or [None])[0]
    layer_windows = getattr(get_model_class(architecture), "layer_sliding_windows", None)
    windows = [w for w in (layer_windows(hf_config) if layer_windows else ()) if w]
    if windows and min(windows) < max_model_len:
        logger.info("disable_sliding_window: max_model_len %d capped at the sliding "
                    "window, %d", max_model_len, min(windows))
        return min(windows)
    return max_model_len


def _resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    derived = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        derived = getattr(hf_config, key, None)
        if derived:
            break
    derived = int(derived or 2048)
    if getattr(hf_config, "model_type", None) in _OFFSET_POSITION_MODEL_TYPES:
        pad = getattr(hf_config, "pad_token_id", None)
        derived -= (1 if pad is None else pad) + 1
    if requested is None:
        return min(derived, 8192)
    if requested < 1:
        raise ConfigError(f"max_model_len must be >= 1, got {requested}")
    if (requested > derived
            and getattr(hf_config, "model_type", None) in _LEARNED_POSITION_MODEL_TYPES):
        raise ConfigError(f"User-specified max_model_len ({requested}) is greater than the "
                          f"derived max_model_len ({derived}): this model's learned position "
                          f"embeddings cover {derived} positions")
    if requested > derived:
        # Rotary positions extend past training, as llama.cpp allows a larger context:
        # said once, since outputs past the trained length are usually poor.
        logger.warning("max_model_len %d is greater than the %d positions this model was "
                       "trained on: outputs past them may be poor", requested, derived)
    return requested

