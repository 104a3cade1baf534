"""Speculative decoding in the model runner: proposing tokens after a step (n-gram
prompt lookup or a draft model) and verifying them in the next, with rejection sampling
(sample/rejection_sampler.py) and seeded generators left as plain decoding leaves them."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.contracts import ModelRunnerOutput, TokenLogprobs
from pagedllm.distributed.comm import broadcast
from pagedllm.distributed.parallel_state import ParallelState
from pagedllm.models.layers.linear import pack_linear_weights
from pagedllm.sample.ops import skip_draws
from pagedllm.sample.rejection_sampler import accept_drafts
from pagedllm.sample.sampler import Sampler
from pagedllm.worker.draft_proposer import DraftModelProposer
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_loader import load_model
from pagedllm.worker.ngram_proposer import NgramProposer
from pagedllm.worker.step_inputs import StepInputs, apply_grammar
from pagedllm.worker.weight_pages import move_to_huge_pages


class SpecDecoder:
    """The runner's proposer, and the verification of a step's proposals."""

    def __init__(self, proposer: NgramProposer | DraftModelProposer, sampler: Sampler,
                 parallel: ParallelState, device: torch.device) -> None:
        self.proposer = proposer
        self.sampler = sampler
        self.parallel = parallel
        self.device = device

    def verify(self, batch: InputBatch, inputs: StepInputs, logits: torch.Tensor,
               output: ModelRunnerOutput) -> None:
        """A step with proposals: draw a token at every scored position, emit the
        accepted proposals plus one draw per request (sample/rejection_sampler.py), and
        record them as ModelRunner._sample does. Not under PP (the config refuses it)."""
        counts = inputs.num_logits
        rows = np.repeat(inputs.sample_rows, counts)  # each position samples as its row
        starts = (np.cumsum(counts) - counts).tolist()  # each request's first logits row
        sampler_output = None
        if self.parallel.is_driver:
            md = batch.sampling_metadata(rows)
            apply_grammar(md, inputs.grammar, len(rows), self.device)
            # Seeded rows draw once per position; the draws of positions after a
            # rejection are given back below, so the generator advances once per token.
            saved = {start: md.generators[start].get_state()
                     for start, count in zip(starts, counts.tolist())
                     if count > 1 and start in md.generators}
            sampler_output = self.sampler(logits, md)
            sampled_t = sampler_output.sampled_token_ids
        else:
            sampled_t = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        sampled = broadcast(sampled_t.contiguous(), self.parallel).cpu().numpy()
        emitted = accept_drafts(sampled, counts, inputs.drafts)
        if sampler_output is not None:
            self._rewind_generators(md.generators, saved, starts, counts, emitted)
        for j in range(max(len(e) for e in emitted)):
            sel = [i for i, e in enumerate(emitted) if len(e) > j]
            batch.append_sampled(inputs.sample_rows[sel],
                                 np.array([emitted[i][j] for i in sel], dtype=np.int64))
        for pos, tokens in zip(inputs.sample_positions.tolist(), emitted):
            output.sampled_token_ids[pos] = tokens
        if sampler_output is not None and sampler_output.logprobs is not None:
            per_row = sampler_output.logprobs.tolists(
                batch.sampling.num_logprobs[rows].tolist())
            out: list[list[TokenLogprobs]] = [[] for _ in inputs.req_ids]
            for pos, start, tokens in zip(inputs.sample_positions.tolist(), starts,
                                          emitted):
                if per_row[start] is not None:
                    out[pos] = per_row[start:start + len(tokens)]
            output.logprobs = out

    def _rewind_generators(self, generators: dict[int, torch.Generator],
                           saved: dict[int, torch.Tensor], starts: list[int],
                           counts: np.ndarray, emitted: list[list[int]]) -> None:
        """Leave each seeded, verified request's generator advanced by one draw per
        emitted token, as plain decoding would (same tokens, whatever was proposed)."""
        for i, (start, tokens) in enumerate(zip(starts, emitted)):
            if start not in saved or len(tokens) == counts[i]:
                continue
            gen = generators[start]
            gen.set_state(saved[start])
            skip_draws(gen, len(tokens), self.device)

    def propose(self, batch: InputBatch, inputs: StepInputs,
                output: ModelRunnerOutput) -> None:
        """Tokens to verify next step for the requests that just sampled (only those
        whose sampling allows it; see SamplingState.can_speculate). A draft model also
        catches up on every request of the step."""
        if not self.parallel.is_driver:
            return
        sample_rows, sample_positions = inputs.sample_rows, inputs.sample_positions
        eligible = batch.sampling.can_speculate(sample_rows)
        proposals = {}
        if isinstance(self.proposer, DraftModelProposer):
            proposing = np.zeros(len(inputs.rows), dtype=bool)
            proposing[sample_positions[eligible]] = True
            # Positions that stand: the step's tokens less rejected proposals, plus the
            # token just emitted (num_tokens, for the requests that sampled).
            ends = inputs.num_computed + inputs.num_scheduled
            ends[sample_positions] = batch.num_tokens[sample_rows]
            drafts = self.proposer.propose(batch, inputs.rows, inputs.num_computed, ends,
                                           proposing)
            proposals = {inputs.req_ids[i]: d for i, d in enumerate(drafts) if d}
        else:
            for row, pos in zip(sample_rows[eligible].tolist(),
                                sample_positions[eligible].tolist()):
                tokens = self.proposer.propose(batch.token_ids[row, :batch.num_tokens[row]])
                if tokens:
                    proposals[inputs.req_ids[pos]] = tokens
        output.spec_token_ids = proposals or None


def make_proposer(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                  ) -> NgramProposer | DraftModelProposer | None:
    """The speculative decoding proposer of the config (None: no speculation)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max)
    draft = load_model(spec.draft, config.device.attention_backend, device, dtype)
    if device.type == "cpu":
        pack_linear_weights(draft)
        move_to_huge_pages(draft)
    return DraftModelProposer(draft, spec.num_speculative_tokens, config.cache.block_size,
                              device)
