"""Prompt logprobs: the model's log-probabilities of the prompt tokens a step computed.

Kept apart from sampling_state.py (which InputBatch imports) because it reads the whole
InputBatch: the two modules then import in one direction only.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.contracts import PromptLogprobsChunk, TokenLogprobs
from pagedllm.sample.sampler import score_values
from pagedllm.worker.input_batch import InputBatch

# Logits scored at once (rows x vocabulary): 64 MB per float32 tensor.
MAX_LOGITS_ELEMENTS = 16 << 20


def prompt_logprobs_chunks(model: torch.nn.Module, hidden: torch.Tensor, batch: InputBatch,
                           req_ids: list[str], query_start_loc: np.ndarray,
                           logprobs_mode: str = "raw_logprobs",
                           ) -> dict[str, PromptLogprobsChunk] | None:
    """Prompt logprobs of the prompt positions computed this step.

    The hidden state at position p predicts token p + 1, so a request whose scheduled
    positions are [c, c + n) scores prompt tokens c + 1 .. min(c + n, P - 1) with
    P = num_prompt_tokens (the last prompt position predicts the first output token,
    which is sampled, not scored). Loops over the (rare) requests that asked.
    """
    sampling = batch.sampling
    chunks: dict[str, PromptLogprobsChunk] = {}
    for i, req_id in enumerate(req_ids):
        row = batch.req_id_to_row[req_id]
        k = int(sampling.num_prompt_logprobs[row])
        if k < 0:
            continue
        computed = int(batch.num_computed_tokens[row])
        num_sched = int(query_start_loc[i + 1] - query_start_loc[i])
        end = min(computed + num_sched, int(batch.num_prompt_tokens[row]) - 1)
        if end <= computed:
            continue
        # Flattened token index of position p: query_start_loc[i] + (p - computed).
        first = int(query_start_loc[i])
        # A few [rows, vocab] float32 tensors live at once per piece: pieces keep them
        # small whatever the chunk (a 2,048-token chunk of a 256k vocabulary would
        # otherwise take ~2 GB each).
        piece = max(1, MAX_LOGITS_ELEMENTS // batch.vocab_size)
        entries: list[TokenLogprobs | None] = []
        for start in range(computed, end, piece):
            stop = min(start + piece, end)
            offset = first + start - computed
            logits = model.compute_logits(hidden[offset:offset + stop - start])
            if logits is None:
                break  # a tensor parallel rank but 0: it only took part in the gather
            targets = torch.from_numpy(batch.token_ids[row, start + 1:stop + 1])
            # No processor, penalty or temperature acts on a prompt token: the
            # processed modes report what the raw ones do.
            lp = score_values(logits, targets.to(logits.device), k, logprobs_mode)
            entries += lp.tolists([k] * (stop - start))
        if entries:
            chunks[req_id] = PromptLogprobsChunk(start=computed + 1, entries=entries)
    return chunks or None
