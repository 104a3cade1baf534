"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.attention.kv_quant import kv_cache_torch_dtype, verify_kv_cache_support
from pagedllm.attention.metadata import AttentionMetadata, host_to_device
from pagedllm.config import EngineConfig
from pagedllm.core.contracts import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.distributed.comm import broadcast, recv_from_prev_stage, send_to_next_stage
from pagedllm.distributed.parallel_state import SINGLE_RANK, ParallelState
from pagedllm.kernels.cpu.ops import cpu_ops_available
from pagedllm.logits_process import ProcessorContext
from pagedllm.models.layers.linear import pack_linear_weights
from pagedllm.sample.logprobs import LogprobsTensors
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.models.pipeline import layer_range
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kv_layout import check_layer_windows, kv_cache_layout
from pagedllm.worker.kv_offload import HostKVTier
from pagedllm.worker.kv_transfer import KVTransfer
from pagedllm.worker.lora_manager import LoRAManager
from pagedllm.worker.invariance import batch_invariance_caveat
from pagedllm.worker.mm_encoder import ImageEncoderCache
from pagedllm.worker.memory import (allocate_kv_cache, attention_layers,
                                    determine_num_blocks, determine_num_swap_blocks,
                                    kv_bytes_per_block, peak_allocated_bytes, profile_batch,
                                    unbind_kv_cache)
from pagedllm.worker.model_loader import load_model
from pagedllm.worker.cuda_graphs import CudaGraphCapture, DecodeGraphs
from pagedllm.worker.deferred_sample import DeferredSample, HostCopy
from pagedllm.worker.draft_proposer import DraftModelProposer
from pagedllm.worker.pooler import pool_hidden_states, score_head_of
from pagedllm.worker.prompt_rows import attach_step_rows, prompt_rows
from pagedllm.worker.prompt_logprobs import prompt_logprobs_chunks
from pagedllm.worker.spec_decode import SpecDecoder, make_proposer
from pagedllm.worker.step_inputs import (StepInputs, apply_grammar, grammar_rows, placeholders,
                                         slot_tables, token_positions, verify_rows,
                                         write_drafts)
from pagedllm.worker.step_profiler import StepProfiler
from pagedllm.worker.swap import allocate_host_kv_cache, swap_blocks
from pagedllm.worker.weight_pages import move_to_huge_pages, trim_heap

logger = logging.getLogger(__name__)


class StepOutput:
    """A launched step's `ModelRunnerOutput`: `get()` finishes it (reads the sampled ids
    back, the step's one wait for the device, and records them) the first time."""

    def __init__(self, output: ModelRunnerOutput,
                 finish: Callable[[ModelRunnerOutput], None] | None = None) -> None:
        self._output = output
        self._finish = finish

    def get(self) -> ModelRunnerOutput:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish(self._output)
        return self._output


class ModelRunner:
    """One worker's model (its shard under tensor parallelism) and per-request state.

    Under TP every rank gets the same SchedulerOutput and runs the same forward pass (the
    layers communicate); rank 0 samples and broadcasts the sampled ids so every rank's
    InputBatch holds the same tokens. Under PP a stage runs its layers on the previous
    stage's hidden states and sends its own to the next; the last stage samples, and
    the sampled ids reach every rank through the next SchedulerOutput
    (`CachedRequestData.new_token_ids`) instead, as steps overlap. Only the driver's
    (TP rank 0 of the last stage) ModelRunnerOutput is meaningful.
    """

    def __init__(self, config: EngineConfig, parallel: ParallelState = SINGLE_RANK) -> None:
        self.config = config
        self.parallel = parallel
        self.device = torch.device(config.device.device)
        if self.device.type == "cuda":
            # A data parallel replica's own GPU; set as current so that calls without a
            # device (memory queries, streams, graph capture) mean it too.
            self.device = torch.device("cuda", config.device.device_index)
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, config.model.dtype)
        # The KV cache's storage dtype (fp8 or the model's): sizes and allocates the cache.
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, self.dtype)
        verify_kv_cache_support(self.kv_cache_dtype, config.device.attention_backend,
                                self.device)
        self.block_size = config.cache.block_size
        self.max_model_len = config.scheduler.max_model_len
        if self.device.type == "cpu":
            torch.set_num_threads(config.device.num_threads)
        if config.device.compile and parallel.pp_size > 1:
            raise ValueError("compile is not supported with pipeline parallelism")
        # Under PP: the send of the last step's hidden states, in flight (Work, tensor).
        self._pending_send: tuple[object, torch.Tensor] | None = None
        self.hidden_size = config.model.hf_config.hidden_size
        self.vocab_size = config.model.hf_config.vocab_size
        self.sampler = Sampler(config.model.logprobs_mode)
        self._build_model()
        if self._step_rows is not None and parallel.is_driver:
            logger.info("quantized GEMM: prompt tokens on AMX bfloat16 tiles, generated "
                        "tokens on the int8 kernels (PAGEDLLM_CPU_QUANT_GEMM=int8 | "
                        "amx_bf16: every token on one)")
        caveat = batch_invariance_caveat(config, cpu_ops_available(torch.empty(0)))
        if caveat is not None and parallel.is_driver:
            logger.info("outputs may differ with batching, chunked prefill and prefix "
                        "caching: %s", caveat)
        # KV cache groups (sliding-window layers get their own block tables): the same
        # layout on every worker and in the scheduler; this worker's layers start at
        # first_layer of the whole model (pipeline parallelism).
        self.kv_layout = kv_cache_layout(config)
        self.first_layer = layer_range(config.model.hf_config.num_hidden_layers, parallel)[0]
        self.input_batch: InputBatch | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Host blocks of swap preemption, one tensor per KV cache tensor ([] unless
        # swapping).
        self.host_kv_caches: list[torch.Tensor] = []
        # Blocks kept beyond the cache, keyed by hash (None: not configured): shared
        # with other engines through a directory, or the prefix cache's host tier (its
        # slots are allocated with the cache).
        self.kv_transfer: KVTransfer | HostKVTier | None = None
        if config.kv_transfer is not None and not config.kv_transfer.is_offloading:
            self.kv_transfer = KVTransfer(config.kv_transfer.storage_path, parallel)
        # Captured decode steps (CUDA; None: every step runs eagerly).
        self.graphs: DecodeGraphs | None = None
        # Async scheduling: a step's sampled ids are read when the engine asks for its
        # output, after the next step is launched (whose placeholders take them on the
        # device). Launched steps whose ids are not read yet, oldest first.
        self.async_scheduling = config.scheduler.async_scheduling
        self._unread: list[DeferredSample] = []
        # Sleep mode: what is released ("weights", "kv_cache"), and the KV sizes to
        # allocate again on waking.
        self.asleep: set[str] = set()
        self._kv_sizes = (0, 0)
        # The torch profiler while one records (start_profile).
        self._profiler = StepProfiler(config.device.profiler, self.device.type)
        self._num_profiles = 0

    def _build_model(self, model: nn.Module | None = None) -> None:
        """Load the model (or take `model`, loaded) and build what holds it: at start-up,
        waking from sleep level 2 (read again from the model's files), with new
        weights."""
        config, parallel = self.config, self.parallel
        self.model = model or load_model(config.model, config.device.attention_backend,
                                         self.device, self.dtype, parallel)
        # model(input_ids, positions, attn_metadata) -> hidden, eager or compiled.
        self._forward = self.model
        if config.device.compile:
            from pagedllm.worker.compile import CompiledForward

            self._forward = CompiledForward(self.model, Path(config.device.compile_cache_dir))
        elif self.device.type == "cpu":
            # Eager CPU: oneDNN-packed weights (compiled graphs pack their own), the
            # native kernels' on huge pages.
            pack_linear_weights(self.model)
            move_to_huge_pages(self.model)
        # Prompt rows on other kernels than generated ones (worker/prompt_rows.py; None:
        # every row alike): the step's marks, bound around each forward pass for the
        # Python layers' linears.
        self._step_rows = attach_step_rows(self.model, self.dtype, self.device,
                                           config.device.compile)
        # LoRA adapters per request (None: LoRA off).
        self.lora = None
        if config.lora is not None:
            self.lora = LoRAManager(self.model, config.lora, config.model.hf_config,
                                    self.device)
        # Speculative decoding (None: off).
        proposer = make_proposer(config, self.device, self.dtype)
        self.spec = (SpecDecoder(proposer, self.sampler, parallel, self.device)
                     if proposer is not None else None)
        # Image features of multimodal prompts, and prompt embeddings (None: the model
        # takes neither).
        self.images = (ImageEncoderCache(self.model, self.device)
                       if getattr(self.model, "is_multimodal", False)
                       or config.model.enable_prompt_embeds else None)

    def _draft(self) -> DraftModelProposer | None:
        """The draft model of speculative decoding, if it has one."""
        proposer = self.spec.proposer if self.spec is not None else None
        return proposer if isinstance(proposer, DraftModelProposer) else None

    def _draft_bytes_per_block(self) -> int:
        draft = self._draft()
        return 0 if draft is None else kv_bytes_per_block(draft.model, self.block_size,
                                                          self.kv_cache_dtype)

    def determine_num_blocks(self) -> int:
        """KV blocks of this worker, block 0 included (worker/memory.py): on CUDA what
        gpu_memory_utilization leaves after the weights and a profiled step
        (`profile_run`), elsewhere kv_cache_space; num_kv_blocks overrides both.
        Pipeline parallelism (CPU only so far) keeps kv_cache_space: a stage's step
        would need its neighbours' hidden states."""
        profiled = self.device.type == "cuda" and self.parallel.pp_size == 1
        # The memory statistics read the current CUDA device: make it the runner's.
        with torch.cuda.device(self.device) if profiled else contextlib.nullcontext():
            return determine_num_blocks(self.model, self.config.cache,
                                        self.config.scheduler, self.kv_cache_dtype,
                                        self.kv_layout, self.first_layer,
                                        self._draft_bytes_per_block(),
                                        profile_run=self.profile_run if profiled else None)

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Activation peak in bytes (0 off CUDA) of the largest step the scheduler may
        send: a forward pass over `profile_batch` (max_num_batched_tokens prompt tokens
        in min(max_num_seqs, tokens) sequences), then the logits and a top-k / top-p
        draw (the sampler's costliest path: a sort of [N, V]) at every row that can
        sample, as vLLM profiles it. The attention layers write a temporary KV cache,
        unbound and freed afterwards. Not the draft model's own forward passes (its
        weights and K/V are counted; its activations are not)."""
        sched, dev = self.config.scheduler, self.device
        batch = profile_batch(sched.max_num_batched_tokens, sched.max_num_seqs,
                              self.max_model_len, self.block_size)
        num_tokens = len(batch.positions)
        # Rows that sample: one per request, 1 + k under speculative decoding.
        spec = self.config.speculative
        per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
        num_rows = min(num_tokens, sched.max_num_seqs * per_seq)
        layers = attention_layers(self.model)
        saved = [layer.kv_cache for layer in layers]  # None before initialize_kv_cache
        allocate_kv_cache(self.model, batch.num_blocks, self.block_size,
                          self.kv_cache_dtype, dev, self.kv_layout, self.first_layer)
        md = AttentionMetadata.from_host(batch.query_start_loc, batch.seq_lens,
                                         batch.block_table, batch.slot_mapping, dev)
        # Varied ids (a MoE router then spreads them as real text would).
        input_ids = torch.arange(num_tokens, device=dev) % self.vocab_size
        positions = host_to_device(batch.positions, dev)
        logits_indices = torch.arange(num_tokens - num_rows, num_tokens, device=dev)
        sampling = SamplingMetadata(
            temperature=torch.full((num_rows,), 0.5, dtype=torch.float32, device=dev),
            is_greedy=torch.zeros(num_rows, dtype=torch.bool, device=dev),
            all_greedy=False, all_random=True,
            top_k=torch.full((num_rows,), self.vocab_size - 1, dtype=torch.int64, device=dev),
            top_p=torch.full((num_rows,), 0.99, dtype=torch.float32, device=dev))

        def step() -> None:
            hidden = self._forward(input_ids, positions, md)  # [T, hidden_size]
            logits = self.model.compute_logits(hidden[logits_indices])  # [N, V]
            self.sampler(logits, sampling)

        try:
            return peak_allocated_bytes(step, dev)
        finally:
            # The temporary cache is freed with its last reference, the layers'.
            for layer, cache in zip(layers, saved):
                layer.kv_cache = cache

    def kv_cache_group_windows(self) -> tuple[int | None, ...]:
        return self.kv_layout.group_windows

    def splits_prompt_rows(self) -> bool:
        """Whether the model computes prompt rows on other kernels than generated ones:
        the step's metadata then marks them, and prefix-cache hashes keep the two apart
        (worker/prompt_rows.py)."""
        return self._step_rows is not None

    def kv_bytes_per_block(self) -> int:
        """K and V bytes of one block on this worker (the draft's included)."""
        return (kv_bytes_per_block(self.model, self.block_size, self.kv_cache_dtype,
                                   self.kv_layout, self.first_layer)
                + self._draft_bytes_per_block())

    def determine_num_swap_blocks(self) -> int:
        return determine_num_swap_blocks(self.model, self.config.cache,
                                         self.config.scheduler, self.kv_cache_dtype,
                                         self.kv_layout, self.first_layer,
                                         self._draft_bytes_per_block())

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0,
                            num_offload_blocks: int = 0) -> None:
        """`num_offload_blocks`: slots of the prefix cache's host tier (0: none)."""
        self._kv_sizes = (num_blocks, num_swap_blocks)
        if num_offload_blocks:
            self.kv_transfer = HostKVTier(num_offload_blocks)
        self._allocate_kv_cache()
        self.input_batch = InputBatch(self.config.scheduler.max_num_seqs, self.max_model_len,
                                      self._max_blocks_per_req, self.vocab_size, self.device,
                                      self.kv_layout.num_groups, self._logits_processors())

    @property
    def _max_blocks_per_req(self) -> int:
        return -(-(self.max_model_len + 1) // self.block_size)

    def _allocate_kv_cache(self) -> None:
        """The KV cache (and the swap pool) of `_kv_sizes`, bound to the layers, and the
        decode graphs that read it."""
        num_blocks, num_swap_blocks = self._kv_sizes
        self.kv_caches = allocate_kv_cache(self.model, num_blocks, self.block_size,
                                           self.kv_cache_dtype, self.device, self.kv_layout,
                                           self.first_layer)
        check_layer_windows(self.model, self.kv_layout, self.max_model_len)
        if (draft := self._draft()) is not None:
            if self.kv_layout.num_groups > 1:
                raise ValueError("a draft model needs a target without sliding-window KV "
                                 "cache groups (it reads the first group's block tables)")
            # The draft's K/V in the same block ids; swapped with the target's.
            self.kv_caches += allocate_kv_cache(draft.model, num_blocks,
                                                self.block_size, self.kv_cache_dtype,
                                                self.device)
        self.host_kv_caches = allocate_host_kv_cache(self.kv_caches, num_swap_blocks)
        if isinstance(self.kv_transfer, HostKVTier):
            self.kv_transfer.bind(self.kv_caches)
        if self._graphs_apply():
            # After the KV cache: the graphs hold its addresses.
            dev = self.config.device
            self.graphs = DecodeGraphs(self._forward, self.config.scheduler.max_num_seqs,
                                       self._max_blocks_per_req, self.kv_layout.num_groups,
                                       self.max_model_len, self.device, CudaGraphCapture(),
                                       dev.cuda_graph_sizes, dev.max_cuda_graph_size)

    # ------------------------------------------------------------------ profiling

    def start_profile(self) -> None:
        """Record the steps from now on with torch's profiler (the engine checks that it
        is on and not running already), as DeviceConfig.profiler says."""
        self._profiler.start()

    def stop_profile(self) -> str | None:
        """Stop recording; the trace's path (Chrome trace JSON in profiler_dir), None
        when no step was recorded (its delay_iterations not reached)."""
        stem = Path(self.config.device.profiler_dir) / (
            f"pagedllm-dp{self.config.parallel.data_parallel_rank}-"
            f"pp{self.parallel.pp_rank}-tp{self.parallel.tp_rank}-"
            f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._num_profiles}")
        self._num_profiles += 1
        return self._profiler.stop(stem)

    # ------------------------------------------------------------------ sleep mode

    def update_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """New weights ((hf_name, tensor) pairs, over the model's files' for names not
        given): a model is loaded with them first (a bad name or shape raises and
        changes nothing), then replaces the current one, and the KV cache is bound to it
        afresh (the engine resets its prefix cache: cached K/V came from the old
        weights)."""
        model = load_model(self.config.model, self.config.device.attention_backend,
                           self.device, self.dtype, self.parallel, updates=weights)
        self._drop_model()
        self._build_model(model)
        self.asleep.discard("weights")
        if "kv_cache" not in self.asleep:
            self._allocate_kv_cache()

    def _drop_model(self) -> None:
        """Let go of the model and everything that holds it or its KV cache."""
        self._unbind_kv_cache()
        self.model = self._forward = self._step_rows = None
        self.lora = self.spec = self.images = None
        _release_memory(self.device)

    def _models(self) -> list[nn.Module]:
        """The model, and the draft model of speculative decoding if there is one."""
        draft = self._draft()
        return [m for m in (self.model, draft.model if draft else None) if m is not None]

    def _unbind_kv_cache(self) -> None:
        for model in self._models():
            unbind_kv_cache(model)
        self.kv_caches, self.host_kv_caches, self.graphs = [], [], None
        if isinstance(self.kv_transfer, HostKVTier):
            self.kv_transfer.release()  # (the engine forgot what it held)

    def sleep(self, level: int) -> None:
        """Release the KV cache (its contents are lost: the engine is idle and its
        prefix cache reset) and, at level 2, the weights; on CUDA level 1 moves the
        weights to host memory instead. The engine checks the arguments."""
        if level == 2:
            self._drop_model()
            self.asleep |= {"weights", "kv_cache"}
            return
        self._unbind_kv_cache()
        self.asleep.add("kv_cache")
        if self.device.type == "cuda":
            for model in self._models():
                model.to("cpu")
            self.asleep.add("weights")
        _release_memory(self.device)

    def wake_up(self, tags: list[str]) -> None:
        """Take back what sleep released, of "weights" and "kv_cache" (weights first:
        the cache is laid out by the model's layers; the engine checks that)."""
        if "weights" in tags and "weights" in self.asleep:
            if self.model is None:
                self._build_model()
            else:
                for model in self._models():
                    model.to(self.device)
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self._allocate_kv_cache()
            self.asleep.discard("kv_cache")


    def _graphs_apply(self) -> bool:
        """Whether decode steps replay CUDA graphs: on CUDA with the triton backend,
        unless enforce_eager, more than one worker (collectives stay eager) or a model
        whose forward syncs with the host. Under compile the graphs hold the compiled
        forward's kernels (inductor's own graphs stay off: its default mode)."""
        if self.device.type != "cuda":
            return False
        cfg = self.config
        reasons = [why for why, applies in (
            ("enforce_eager", cfg.device.enforce_eager),
            ("more than one worker", self.parallel.tp_size * self.parallel.pp_size > 1),
            (f"attention backend {cfg.device.attention_backend}",
             cfg.device.attention_backend != "triton"),
            (f"{type(self.model).__name__} syncs with the host",
             not getattr(self.model, "supports_cuda_graphs", True))) if applies]
        if reasons and self.parallel.is_driver:
            logger.info("decode steps run eagerly (no CUDA graphs): %s", ", ".join(reasons))
        return not reasons

    def _logits_processors(self) -> tuple[Any, ...]:
        """The engine's custom logits processors, one instance each (this worker's)."""
        context = ProcessorContext(model_path=self.config.model.path,
                                   vocab_size=self.vocab_size, device=self.device)
        return tuple(cls(context) for cls in self.config.logits_processors)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(so).get()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> StepOutput:
        """Run the step; under async scheduling its sampled ids stay on the device until
        the output's `get()` (one runner: its sampling is never deferred otherwise)."""
        self._profiler.before_step()
        # Before anything reads or writes the cache (even in a step with no tokens).
        if so.blocks_to_swap_out or so.blocks_to_swap_in:
            swap_blocks(self.kv_caches, self.host_kv_caches, so.blocks_to_swap_out,
                        so.blocks_to_swap_in)
        load_failures = (self.kv_transfer.load(self.kv_caches, so.kv_blocks_to_load)
                         if so.kv_blocks_to_load else None)
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return StepOutput(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        inputs = self._prepare_inputs(so)
        failed_loras: dict[int, str] = {}
        with (self._step_rows.bound(inputs.attn_metadata.prompt_rows)
              if self._step_rows is not None else contextlib.nullcontext()):
            if inputs.graph_bucket is not None:
                hidden = self.graphs.replay(inputs.graph_bucket,
                                            inputs.attn_metadata.num_reqs)
            elif inputs.lora_ids is not None:
                failed_loras = self.lora.begin_step(inputs.lora_ids, inputs.loras)
                try:
                    hidden = self._run_layers(inputs)
                finally:
                    self.lora.end_step()
            else:
                hidden = self._run_layers(inputs)
        if not self.parallel.is_last_stage:
            if so.kv_blocks_to_save:  # (this stage's layers, written by its forward pass)
                self.kv_transfer.save(self.kv_caches, so.kv_blocks_to_save)
            return StepOutput(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        output = ModelRunnerOutput(req_ids=inputs.req_ids,
                                   sampled_token_ids=[[] for _ in inputs.req_ids],
                                   kv_load_failures=load_failures or None)
        if failed_loras:
            output.failed_requests = self._requests_of_loras(inputs.req_ids, failed_loras)
        deferred = None
        if len(inputs.sample_rows):
            deferred = self._sample(inputs, hidden, output)
        if deferred is not None and not self.async_scheduling:
            self._read_sampled(deferred, output)
            deferred = None
        if self.spec is not None:
            self.spec.propose(self.input_batch, inputs, output)
        if so.kv_blocks_to_save:
            # The forward pass has written them, and a draft model its K/V of the same
            # positions (its catch-up in propose).
            self.kv_transfer.save(self.kv_caches, so.kv_blocks_to_save)
        if self.input_batch.sampling.has_prompt_logprobs():
            output.prompt_logprobs = prompt_logprobs_chunks(
                self.model, hidden, self.input_batch, inputs.req_ids,
                inputs.attn_metadata.query_start_loc_cpu, self.config.model.logprobs_mode)
        if self.parallel.is_driver and self.input_batch.pooling_params:
            # Under TP every rank holds the full hidden states; only the driver reports.
            output.pooler_output = pool_hidden_states(
                hidden, self.input_batch, inputs.req_ids, inputs.rows,
                inputs.attn_metadata.query_start_loc_cpu,
                score_head_of(self.model, self.config.model.pooler))
        if deferred is None:
            return StepOutput(output)
        return StepOutput(output, lambda out: self._read_sampled(deferred, out))

    def _run_layers(self, inputs: StepInputs) -> torch.Tensor:
        """The model's forward pass, or this pipeline stage's part of it."""
        if self.parallel.pp_size > 1:
            return self._forward_stage(inputs)
        return self._forward(inputs.input_ids, inputs.positions, inputs.attn_metadata,
                             **self._token_types(inputs), **self._image_embeds(inputs))

    def _forward_stage(self, inputs: StepInputs) -> torch.Tensor:
        """This pipeline stage's layers: on the previous stage's hidden states (received),
        their output sent on to the next stage (the send left in flight)."""
        ps = self.parallel
        received = None
        if not ps.is_first_stage:
            received = recv_from_prev_stage(
                (inputs.attn_metadata.num_actual_tokens, self.hidden_size), self.dtype, ps,
                self.device)
        # Images are embedded where the tokens are: on the first stage.
        images = self._image_embeds(inputs) if ps.is_first_stage else {}
        hidden = self._forward(inputs.input_ids, inputs.positions, inputs.attn_metadata,
                               received, **images)
        if not ps.is_last_stage:
            if self._pending_send is not None:
                self._pending_send[0].wait()  # one send in flight at a time
            hidden = hidden.contiguous()
            self._pending_send = (send_to_next_stage(hidden, ps), hidden)
        return hidden

    def _sample(self, inputs: StepInputs, hidden: torch.Tensor,
                output: ModelRunnerOutput) -> DeferredSample | None:
        """Sample the requests of `inputs.sample_rows`, record their tokens in the input
        batch (unless under PP: they come with the next step) and in `output` (sampled
        ids, logprobs). One runner leaves that to `_read_sampled` of the returned
        DeferredSample, with the ids still on the device."""
        # [N, V]; None on TP ranks but 0, which only take part in the logits gather.
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
        logits = self.model.compute_logits(hidden)
        if inputs.num_logits is not None:
            self.spec.verify(self.input_batch, inputs, logits, output)
            return None
        sampler_output = None
        pipelined = self.parallel.pp_size > 1
        batch = self.input_batch
        if self.parallel.is_driver:
            md = batch.sampling_metadata(inputs.sample_rows)
            apply_grammar(md, inputs.grammar, len(inputs.sample_rows), self.device)
            sampler_output = self.sampler(logits, md)
            if md.custom_failures:
                positions = inputs.sample_positions.tolist()
                output.errored_requests = {inputs.req_ids[positions[i]]: why
                                           for i, why in md.custom_failures.items()}
            sampled_t = sampler_output.sampled_token_ids  # [N] int64
            if self.parallel.tp_size == 1 and not pipelined:
                deferred = DeferredSample(
                    sampled=sampled_t, copy=HostCopy(sampled_t), rows=inputs.sample_rows,
                    generations=batch.generation[inputs.sample_rows],
                    positions=inputs.sample_positions, logprobs=sampler_output.logprobs,
                    num_logprobs=batch.sampling.num_logprobs[inputs.sample_rows])
                self._unread.append(deferred)
                return deferred
        elif pipelined:
            return None
        else:
            sampled_t = torch.empty(len(inputs.sample_rows), dtype=torch.int64,
                                    device=self.device)
        if pipelined:
            sampled = sampled_t.cpu().numpy()
        else:
            # Every rank appends the same tokens, so the next step's inputs agree.
            sampled = broadcast(sampled_t.contiguous(), self.parallel).cpu().numpy()
            self.input_batch.append_sampled(inputs.sample_rows, sampled)
        for pos, tok in zip(inputs.sample_positions.tolist(), sampled.tolist()):
            output.sampled_token_ids[pos] = [tok]
        if sampler_output is not None and sampler_output.logprobs is not None:
            output.logprobs = _sample_logprobs(
                len(inputs.req_ids), inputs.sample_positions, sampler_output.logprobs,
                batch.sampling.num_logprobs[inputs.sample_rows])
        return None

    def _read_sampled(self, deferred: DeferredSample, output: ModelRunnerOutput) -> None:
        """Read a step's sampled ids back (waiting for them), record them in the input
        batch for the rows that still hold their requests, and in `output`."""
        sampled = deferred.copy.numpy()
        self._unread.remove(deferred)
        rows = deferred.rows
        live = self.input_batch.generation[rows] == deferred.generations
        self.input_batch.append_sampled(rows[live], sampled[live])
        for pos, tok in zip(deferred.positions.tolist(), sampled.tolist()):
            output.sampled_token_ids[pos] = [tok]
        if deferred.logprobs is not None:
            output.logprobs = _sample_logprobs(len(output.req_ids), deferred.positions,
                                               deferred.logprobs, deferred.num_logprobs)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove_request(req_id, preempted=req_id not in so.finished_req_ids)
            if self.images is not None:
                self.images.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.add_request(new)
            if self.images is not None:
                self.images.add_request(new)
        rows, tokens = [], []
        for cached in so.scheduled_cached_reqs:
            row = batch.req_id_to_row[cached.req_id]
            batch.num_computed_tokens[row] = cached.num_computed_tokens
            if any(cached.new_block_ids):
                batch.append_blocks(row, cached.new_block_ids)
            if cached.new_token_ids:
                # Under PP: the tokens the last stage sampled for it (one per step).
                assert len(cached.new_token_ids) == 1, cached
                rows.append(row)
                tokens.append(cached.new_token_ids[0])
        if rows:
            batch.append_sampled(np.array(rows), np.array(tokens, dtype=np.int64))

    def _token_types(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """`token_type_ids` for a model that reads them (a cross-encoder): 1 on the
        tokens at or past their request's PoolingParams.token_type_start, else 0; {} for
        every other model."""
        if not getattr(self.model, "takes_token_type_ids", False):
            return {}
        pooling = self.input_batch.pooling_params
        no_pair = self.max_model_len  # a position no token reaches: all type 0
        starts = np.array([getattr(pooling.get(r), "token_type_start", None) or no_pair
                           for r in inputs.req_ids], dtype=np.int64)
        query_start_loc = inputs.attn_metadata.query_start_loc_cpu
        req_of = np.repeat(np.arange(len(inputs.req_ids)), np.diff(query_start_loc))
        positions = inputs.positions.cpu().numpy()
        types = torch.from_numpy((positions >= starts[req_of]).astype(np.int64))
        return {"token_type_ids": types.to(inputs.positions.device)}

    def _image_embeds(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """`inputs_embeds` with the image rows of the step's placeholder tokens; {}
        when the step computes none (or the model takes no images)."""
        if self.images is None:
            return {}
        embeds = self.images.inputs_embeds(inputs.input_ids, inputs.req_ids,
                                           inputs.num_computed, inputs.num_scheduled,
                                           inputs.attn_metadata.query_start_loc_cpu)
        return {} if embeds is None else {"inputs_embeds": embeds}

    def _requests_of_loras(self, req_ids: list[str], reasons: dict[int, str],
                           ) -> dict[str, str]:
        """req_id -> reason, for the step's requests whose adapter is in `reasons`."""
        batch = self.input_batch
        return {req_id: reasons[lora_id] for req_id in req_ids
                if (lora_id := int(batch.lora_ids[batch.req_id_to_row[req_id]])) in reasons}

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), np.int64, len(req_ids))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), np.int64, len(req_ids))
        computed = batch.num_computed_tokens[rows]
        query_start_loc, positions, req_of = token_positions(computed, num_sched)
        total = int(query_start_loc[-1])
        token_rows = rows[req_of]
        lora_ids = loras = None
        if self.lora is not None and batch.lora_ids[rows].any():
            lora_ids = batch.lora_ids[token_rows]
            loras = {batch.loras[row].lora_int_id: batch.loras[row]
                     for row in rows.tolist() if row in batch.loras}
        spec = so.scheduled_spec_decode_tokens
        write_drafts(batch, spec)
        input_ids = batch.token_ids[token_rows, positions]
        num_tokens = batch.num_tokens[rows]
        unread = None
        if self._unread:
            # Async scheduling: requests that sampled in the step in flight continue
            # with that token, which only the device has yet.
            unread, pending = placeholders(batch, self._unread, token_rows, positions, rows)
            input_ids[unread[0]] = 0  # filled on the device below
            num_tokens = num_tokens + pending
        seq_lens = computed + num_sched
        # A request samples once its sequence is fully computed (prefill done or decoding);
        # an embedding request never does (it is pooled instead).
        samples = (seq_lens >= num_tokens) & ~batch.is_pooling[rows]
        sample_positions = np.nonzero(samples)[0]
        tables = slot_tables(batch, self.kv_layout.group_windows, self.block_size, rows,
                             token_rows, positions, computed,
                             num_blocks=-(-int(seq_lens.max()) // self.block_size))
        bucket = None
        if self.graphs is not None and not spec and lora_ids is None and not (
                self.images is not None
                and self.images.any_scheduled(req_ids, computed, num_sched)):
            bucket = self.graphs.bucket_for(len(req_ids), int(num_sched.max()))
        input_ids_t, positions_t, md = self._device_inputs(
            bucket, input_ids, positions, query_start_loc, seq_lens, tables, token_rows)
        if unread is not None:
            self._fill_placeholders(input_ids_t, *unread, total)
        logits_indices = query_start_loc[1:][samples] - 1
        num_logits = drafts = None
        if spec:
            drafts = [spec.get(req_ids[i]) for i in sample_positions.tolist()]
            num_logits, logits_indices = verify_rows(logits_indices, drafts)
        grammar = None
        if so.structured_output_rows and self.parallel.is_last_stage:
            grammar = grammar_rows(so, req_ids, sample_positions, num_logits)
        return StepInputs(
            input_ids=input_ids_t, positions=positions_t, attn_metadata=md, req_ids=req_ids,
            logits_indices=(None if len(logits_indices) == total  # increasing: 0..T-1
                            else host_to_device(logits_indices, self.device)),
            sample_rows=rows[samples], sample_positions=sample_positions, rows=rows,
            num_logits=num_logits, drafts=drafts, num_computed=computed,
            num_scheduled=num_sched, graph_bucket=bucket, grammar=grammar,
            lora_ids=lora_ids, loras=loras)

    def _device_inputs(self, bucket: int | None, input_ids: np.ndarray,
                       positions: np.ndarray, query_start_loc: np.ndarray,
                       seq_lens: np.ndarray, tables: list[tuple[np.ndarray, np.ndarray]],
                       token_rows: np.ndarray,
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, attention metadata) on the device: staged in the CUDA
        graph's buffers for a decode step of a captured size (`bucket`), else copied."""
        if bucket is not None:
            return self.graphs.stage(bucket, input_ids, positions, query_start_loc,
                                     seq_lens, tables)
        dev = self.device
        md = AttentionMetadata.from_host(query_start_loc, seq_lens, *tables[0], dev)
        if self._step_rows is not None:
            md.prompt_rows = prompt_rows(positions,
                                         self.input_batch.num_prompt_tokens[token_rows])
        if len(tables) > 1:
            md.groups = (md, *(replace(md, block_table=host_to_device(table, dev),
                                       slot_mapping=host_to_device(slots, dev))
                               for table, slots in tables[1:]))
        return host_to_device(input_ids, dev), host_to_device(positions, dev), md

    def _fill_placeholders(self, input_ids: torch.Tensor, token_index: np.ndarray,
                           sample_index: np.ndarray, total: int) -> None:
        """The tokens only the device has (`step_inputs.placeholders`) into input_ids,
        from the unread step's sampled ids."""
        sampled = self._unread[0].sampled
        if len(token_index) == total and (sample_index == token_index).all():
            # Every token is the sample of the request in its place last step (a
            # steady decode batch): one copy, no index tensors to send.
            input_ids.copy_(sampled[:total])
        else:
            dev = self.device
            input_ids[host_to_device(token_index, dev)] = \
                sampled[host_to_device(sample_index, dev)]


def _sample_logprobs(num_reqs: int, sample_positions: np.ndarray, lp: LogprobsTensors,
                     num_logprobs: np.ndarray) -> list[list[TokenLogprobs]]:
    """Per request of a step: [TokenLogprobs] if it sampled and asked, else []."""
    per_row = lp.tolists(num_logprobs.tolist())
    out: list[list[TokenLogprobs]] = [[] for _ in range(num_reqs)]
    for pos, entry in zip(sample_positions.tolist(), per_row):
        if entry is not None:
            out[pos] = [entry]
    return out


def _release_memory(device: torch.device) -> None:
    """Give freed tensors' memory back: to the CUDA driver, or (CPU) to the OS, which
    glibc keeps of freed allocations otherwise."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        trim_heap()
