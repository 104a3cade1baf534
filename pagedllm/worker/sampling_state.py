"""SamplingState: per-row sampling parameters of the InputBatch, gathered per step.

Scalar parameters live in preallocated numpy arrays indexed by row, so gathering a
step's rows is one fancy-index per parameter; rare per-request extras (logit bias,
allowed ids, bad words) live in dicts flagged by a per-row bool array, so a step only
loops over the rows that have them. Grammars live in the engine core, which sends each
step's token bitmask with it (engine/structured_output.py); a row only notes that it has
one. Every part of the metadata that no row of the step uses is left None and costs
nothing in the sampler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.attention.metadata import host_to_device
from pagedllm.core.contracts import NewRequestData
from pagedllm.logits_process import RequestLogitsProcessor
from pagedllm.sample.metadata import PenaltyMetadata, SamplingMetadata
from pagedllm.sample.ops import output_token_counts, skip_draws


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device,
                 token_ids: np.ndarray, num_tokens: np.ndarray,
                 num_prompt_tokens: np.ndarray, logits_processors: tuple[Any, ...] = (),
                 ) -> None:
        """`logits_processors`: the engine's custom LogitsProcessor instances."""
        self.vocab_size = vocab_size
        self.device = device
        # Views of the InputBatch arrays (never reallocated): the token history.
        self.token_ids = token_ids
        self.num_tokens = num_tokens
        self.num_prompt_tokens = num_prompt_tokens
        n = max_num_reqs
        self.temperature = np.ones(n, dtype=np.float32)
        self.is_greedy = np.zeros(n, dtype=bool)
        self.top_p = np.ones(n, dtype=np.float32)
        self.top_k = np.full(n, vocab_size, dtype=np.int64)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.presence = np.zeros(n, dtype=np.float32)
        self.frequency = np.zeros(n, dtype=np.float32)
        self.repetition = np.ones(n, dtype=np.float32)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        # -1: not requested.
        self.num_logprobs = np.full(n, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(n, -1, dtype=np.int64)
        self.has_generator = np.zeros(n, dtype=bool)
        self.has_extra = np.zeros(n, dtype=bool)  # bias, allowed ids or bad words
        self.has_grammar = np.zeros(n, dtype=bool)
        # Greedy with nothing else (no penalty, ban, extra, grammar or logprobs): a step
        # of only such rows gets the constant all-greedy metadata (the decode fast path).
        self.is_plain_greedy = np.zeros(n, dtype=bool)
        self.generators: dict[int, torch.Generator] = {}
        # req_id -> (its output tokens then, its generator's state) of a seeded request
        # preempted here: it resumes its draws from there, instead of replaying one draw
        # per output token.
        self._saved_generators: dict[str, tuple[int, torch.Tensor]] = {}
        self.min_tokens_ids: dict[int, list[int]] = {}  # masked until min_tokens
        # Per row, built once when the row is added (a request may bias or allow the
        # whole vocabulary: gathered from Python lists each step, one request with n=128
        # and a full-vocabulary logit_bias made every other stream's tokens 11x slower):
        # the bias as a [V] float32 row, zero for tokens without one, and [V] bool, True
        # where a token is not allowed.
        self.logit_bias: dict[int, torch.Tensor] = {}
        self.disallowed: dict[int, torch.Tensor] = {}
        # Per row, each bad word as (its tokens but the last, as an array; its last).
        self.bad_words: dict[int, list[tuple[np.ndarray, int]]] = {}
        self.logits_processors = logits_processors
        # Per row with any: (processor, the function it gave the row's request) pairs.
        self.custom: dict[int, list[tuple[Any, RequestLogitsProcessor]]] = {}
        # Per row with SamplingParams.logprob_token_ids: those ids ([n] int64).
        self.label_ids: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ rows

    def add(self, row: int, new: NewRequestData) -> None:
        sp = new.sampling_params
        self.is_greedy[row] = sp.is_greedy
        self.temperature[row] = 1.0 if sp.is_greedy else sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k if sp.top_k > 0 else self.vocab_size
        self.min_p[row] = sp.min_p
        self.presence[row] = sp.presence_penalty
        self.frequency[row] = sp.frequency_penalty
        self.repetition[row] = sp.repetition_penalty
        self.min_tokens[row] = sp.min_tokens
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.num_prompt_logprobs[row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        ban = list(sp.stop_token_ids)
        if new.eos_token_id is not None and not sp.ignore_eos:
            ban.append(new.eos_token_id)
        if sp.min_tokens and ban:
            self.min_tokens_ids[row] = ban
        if sp.logit_bias:
            bias = torch.zeros(self.vocab_size, dtype=torch.float32)
            bias[torch.tensor(list(sp.logit_bias))] = torch.tensor(
                list(sp.logit_bias.values()), dtype=torch.float32)
            self.logit_bias[row] = bias.to(self.device)
        if sp.allowed_token_ids:
            disallowed = torch.ones(self.vocab_size, dtype=torch.bool)
            disallowed[torch.tensor(sp.allowed_token_ids)] = False
            self.disallowed[row] = disallowed.to(self.device)
        if sp.logprob_token_ids:
            self.label_ids[row] = torch.tensor(sp.logprob_token_ids, dtype=torch.int64,
                                               device=self.device)
        if sp.bad_words_token_ids:
            self.bad_words[row] = [(np.array(word[:-1], dtype=self.token_ids.dtype),
                                    word[-1]) for word in sp.bad_words_token_ids]
        self.has_extra[row] = (row in self.logit_bias or row in self.disallowed
                               or row in self.bad_words)
        self._add_generator(row, new)
        # (A thinking budget's forced end tag comes through the grammar's bitmask too.)
        self.has_grammar[row] = (sp.structured_outputs is not None
                                 or sp.thinking_token_budget is not None)
        # Asked again when a preempted request comes back (its function then sees the
        # output so far).
        custom = []
        for p in self.logits_processors:
            try:
                fn = p.new_request(sp, new.prompt_token_ids)
            except Exception as e:  # noqa: BLE001 - any failure of user code
                # Fails the request at its next sampled step, through the sampler's
                # path for a function that raises.
                fn = _raising(e)
            if fn is not None:
                custom.append((p, fn))
        if custom:
            self.custom[row] = custom
        self.is_plain_greedy[row] = (
            sp.is_greedy and not self.has_extra[row] and not self.has_grammar[row]
            and not custom
            and row not in self.min_tokens_ids and self.num_logprobs[row] < 0
            and self.presence[row] == 0 and self.frequency[row] == 0
            and self.repetition[row] == 1)

    def _add_generator(self, row: int, new: NewRequestData) -> None:
        sp = new.sampling_params
        self.has_generator[row] = sp.seed is not None and not sp.is_greedy
        if not self.has_generator[row]:
            return
        gen = torch.Generator(device=self.device).manual_seed(sp.seed)
        # Resumed after preemption: the generator as it was after the draws of the
        # tokens already sampled (one per token), so a seeded request's output does not
        # depend on preemption. Its saved state when it has the same tokens as then (a
        # token sampled here may have been dropped since: then, and in another process,
        # the draws are replayed).
        saved = self._saved_generators.pop(new.req_id, None)
        if saved is not None and saved[0] == len(new.output_token_ids):
            gen.set_state(saved[1])
        else:
            skip_draws(gen, len(new.output_token_ids), self.device)
        self.generators[row] = gen

    def save_generator(self, row: int, req_id: str) -> None:
        """Keep the generator state of a row being preempted (before `remove`): every
        token sampled here drew once from it (verified proposals give back the draws
        after a rejection), so its state goes with the row's output tokens."""
        gen = self.generators.get(row)
        if gen is not None:
            num_output = int(self.num_tokens[row] - self.num_prompt_tokens[row])
            self._saved_generators[req_id] = (num_output, gen.get_state())

    def forget(self, req_id: str) -> None:
        """A request finished (perhaps while preempted): drop its saved generator."""
        self._saved_generators.pop(req_id, None)

    def remove(self, row: int) -> None:
        for extra in (self.generators, self.min_tokens_ids, self.logit_bias,
                      self.disallowed, self.bad_words, self.custom, self.label_ids):
            extra.pop(row, None)
        self.has_generator[row] = self.has_extra[row] = self.has_grammar[row] = False
        self.is_plain_greedy[row] = False
        self.min_tokens[row] = 0
        self.num_logprobs[row] = self.num_prompt_logprobs[row] = -1

    def can_speculate(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] bool: rows whose next tokens may be proposed and verified in one
        step. The sampler treats the k + 1 positions of a verified request as copies of
        one row, so rows whose logits transform depends on the tokens before each
        position are left out: penalties, bad words, a grammar, and min_tokens bans
        still ahead; and rows whose logprobs name given tokens (the verifier scores the
        top-k)."""
        num_output = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        ok = ((self.presence[rows] == 0) & (self.frequency[rows] == 0)
              & (self.repetition[rows] == 1) & ~self.has_grammar[rows]
              & (num_output >= self.min_tokens[rows]))
        for per_row in (self.bad_words, self.custom, self.label_ids):
            if per_row:
                ok &= np.fromiter((r not in per_row for r in rows.tolist()), bool,
                                  len(rows))
        return ok

    def has_prompt_logprobs(self) -> bool:
        """True while some live request asked for prompt logprobs."""
        return bool((self.num_prompt_logprobs >= 0).any())

    # ------------------------------------------------------------------ per step

    def metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """Gather the sampling state of `rows` (the rows that sample, in logits order)."""
        if self.is_plain_greedy[rows].all():
            # What the general path below returns for such rows, without its gathers.
            return SamplingMetadata(temperature=None, is_greedy=None, all_greedy=True,
                                    all_random=False)
        dev = self.device
        is_greedy = self.is_greedy[rows]
        all_greedy = bool(is_greedy.all())
        md = SamplingMetadata(
            temperature=None if all_greedy else host_to_device(self.temperature[rows], dev),
            is_greedy=None if all_greedy else host_to_device(is_greedy, dev),
            all_greedy=all_greedy, all_random=not bool(is_greedy.any()))
        if not all_greedy:
            top_p, top_k, min_p = self.top_p[rows], self.top_k[rows], self.min_p[rows]
            if (top_p < 1).any():
                md.top_p = host_to_device(top_p, dev)
            if (top_k < self.vocab_size).any():
                md.top_k = host_to_device(top_k, dev)
            if (min_p > 0).any():
                md.min_p = host_to_device(min_p, dev)
            seeded = np.nonzero(self.has_generator[rows])[0]
            md.generators = {i: self.generators[r]
                             for i, r in zip(seeded.tolist(), rows[seeded].tolist())}
            if not md.all_random:
                random_rows = np.nonzero(~is_greedy)[0]
                md.random_rows = host_to_device(random_rows, dev)
                md.random_row_ids = random_rows.tolist()
        md.penalties = self._penalties(rows)
        md.banned = self._banned(rows)
        if self.has_extra[rows].any():
            md.logit_bias, md.disallowed_mask = self._bias_and_allowed(rows)
        if self.custom:
            md.custom = self._custom(rows)
        num_logprobs = self.num_logprobs[rows]
        if (num_logprobs >= 0).any():
            md.max_num_logprobs = int(num_logprobs.max())
            if self.label_ids:
                md.label_ids = {i: self.label_ids[r] for i, r in enumerate(rows.tolist())
                                if r in self.label_ids} or None
        return md

    def _custom(self, rows: np.ndarray,
                ) -> list[tuple[int, list[tuple[Any, Any]], list[int]]] | None:
        """(logits row, its (processor, function) pairs, its output token ids) of the
        rows with custom logits processors."""
        custom = []
        for i, row in enumerate(rows.tolist()):
            fns = self.custom.get(row)
            if fns is not None:
                output = self.token_ids[row, self.num_prompt_tokens[row]:self.num_tokens[row]]
                custom.append((i, fns, output.tolist()))
        return custom or None

    def _penalties(self, rows: np.ndarray) -> PenaltyMetadata | None:
        presence, frequency = self.presence[rows], self.frequency[rows]
        repetition = self.repetition[rows]
        use_repetition = bool((repetition != 1).any())
        use_presence, use_frequency = bool(presence.any()), bool(frequency.any())
        if not (use_repetition or use_presence or use_frequency):
            return None
        dev = self.device
        num_prompt, num_tokens = self.num_prompt_tokens[rows], self.num_tokens[rows]
        # [N, L]: the rows' token histories, padded to the longest.
        ids = host_to_device(self.token_ids[rows, :int(num_tokens.max())], dev)
        prompt_end = host_to_device(num_prompt, dev)
        counts = output_token_counts(ids, prompt_end,
                                     host_to_device(num_tokens, dev), self.vocab_size)
        prompt_mask = None
        if use_repetition:
            prompt_mask = output_token_counts(ids, torch.zeros_like(prompt_end), prompt_end,
                                              self.vocab_size) > 0
        return PenaltyMetadata(
            presence=host_to_device(presence, dev) if use_presence else None,
            frequency=host_to_device(frequency, dev) if use_frequency else None,
            repetition=host_to_device(repetition, dev) if use_repetition else None,
            output_token_counts=counts, prompt_token_mask=prompt_mask)

    def _banned(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """min_tokens bans and bad-word bans as (logits row, token id) pairs."""
        pairs_rows: list[int] = []
        pairs_ids: list[int] = []
        num_output = self.num_tokens[rows] - self.num_prompt_tokens[rows]
        for i in np.nonzero(num_output < self.min_tokens[rows])[0].tolist():
            ids = self.min_tokens_ids.get(int(rows[i]), ())
            pairs_rows += [i] * len(ids)
            pairs_ids += ids
        if self.bad_words:
            for i in np.nonzero(self.has_extra[rows])[0].tolist():
                row = int(rows[i])
                for token_id in self._bad_word_bans(row):
                    pairs_rows.append(i)
                    pairs_ids.append(token_id)
        if not pairs_rows:
            return None
        return (torch.tensor(pairs_rows, device=self.device),
                torch.tensor(pairs_ids, device=self.device))

    def _bad_word_bans(self, row: int) -> list[int]:
        """Last tokens of bad words whose other tokens end the row's output (vLLM)."""
        words = self.bad_words.get(row)
        if not words:
            return []
        start, end = int(self.num_prompt_tokens[row]), int(self.num_tokens[row])
        banned = []
        for prefix, last in words:
            # Compared as arrays: a word may be thousands of tokens long, compared again
            # every step (as lists: 64 words of 2,000 tokens took 0.1 s a step at n=128).
            if len(prefix) > end - start:
                continue
            if len(prefix) == 0 or np.array_equal(
                    self.token_ids[row, end - len(prefix):end], prefix):
                banned.append(last)
        return banned

    def _bias_and_allowed(self, rows: np.ndarray,
                          ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None,
                                     torch.Tensor | None]:
        """The logit bias of the positions whose row has one ((positions [B], bias rows
        [B, V])) and the [N, V] mask of tokens not allowed (None where no row has either):
        the rows' tables stacked, O(V) a row whatever the number of entries."""
        dev, n = self.device, len(rows)
        extra = [(i, int(rows[i])) for i in np.nonzero(self.has_extra[rows])[0].tolist()]
        biased = [(i, row) for i, row in extra if row in self.logit_bias]
        bias = None
        if biased:
            bias = (torch.tensor([i for i, _ in biased], device=dev),
                    torch.stack([self.logit_bias[row] for _, row in biased]))
        limited = [(i, row) for i, row in extra if row in self.disallowed]
        disallowed = None
        if limited:
            disallowed = torch.zeros(n, self.vocab_size, dtype=torch.bool, device=dev)
            disallowed[torch.tensor([i for i, _ in limited], device=dev)] = torch.stack(
                [self.disallowed[row] for _, row in limited])
        return bias, disallowed


def _raising(e: Exception) -> RequestLogitsProcessor:
    """A request function that raises `e` (what its processor's new_request raised)."""
    def fail(output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        raise e
    return fail
