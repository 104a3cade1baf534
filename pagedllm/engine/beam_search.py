"""Beam search on top of the engine, as vLLM's `LLM.beam_search` does it.

Each step runs every live beam (of every prompt) as a one-token request asking for
2 * beam_width logprobs; the prefix cache serves the shared prefixes, so a step costs
about one decode per beam. Candidates are scored with the raw logprobs; a beam that
emits EOS (unless ignore_eos) is complete and leaves the search.

Score (vLLM's `get_beam_search_score`): cum_logprob / seq_len ** length_penalty, with
seq_len the prompt plus generated tokens, not counting a final EOS.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.engine.input_processor import logprobs_cap, prompt_images
from pagedllm.engine.prompt_embeds import prompt_embeds_of
from pagedllm.errors import InvalidRequestError
from pagedllm.lora_request import LoRARequest
from pagedllm.mm_inputs import ProcessedImage
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pagedllm.inputs import PromptType
    from pagedllm.engine.llm_engine import LLMEngine


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                      length_penalty: float) -> float:
    seq_len = len(tokens)
    if eos_token_id is not None and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cum_logprob / (seq_len ** length_penalty)


@dataclass
class _Instance:
    """The search state of one prompt."""

    num_prompt_tokens: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    lora: LoRARequest | None = None  # its LoRA adapter (None: the base model)
    # Its images, preprocessed once (every step's request carries them again).
    images: list[ProcessedImage] = field(default_factory=list)


def beam_search(engine: LLMEngine, prompts: Sequence[PromptType], params: BeamSearchParams,
                counter: Iterator[int] | None = None,
                loras: Sequence[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
    """`loras`: each prompt's LoRA adapter (None: the base model)."""
    counter = counter if counter is not None else itertools.count()
    eos = engine.input_processor.eos_token_id
    width = params.beam_width
    cap = logprobs_cap(engine.input_processor.max_logprobs,
                       engine.input_processor.vocab_size)
    if 2 * width > cap:  # what each step asks for
        raise InvalidRequestError(f"beam_width {width} needs {2 * width} logprobs per step, "
                                  f"more than the {cap} max_logprobs allows")
    step_params = SamplingParams(
        logprobs=2 * width, max_tokens=1, temperature=params.temperature, ignore_eos=True,
        detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    instances = []
    for prompt, lora in zip(prompts, loras or [None] * len(prompts), strict=True):
        if prompt_embeds_of(prompt) is not None:
            raise InvalidRequestError("beam search takes text or token prompts, not "
                                      "prompt_embeds")
        _, ids = engine.input_processor.tokenize(prompt)
        # Placeholders expanded: each step's prompt holds every image's whole run.
        ids, images = engine.input_processor.with_images(ids, prompt_images(prompt), None)
        engine.input_processor.validate_prompt(ids)
        engine.input_processor.check_lora(lora)
        instances.append(_Instance(len(ids), [BeamSearchSequence(tokens=ids)], lora=lora,
                                   images=[ProcessedImage(i.pixel_values) for i in images]))
    for _ in range(params.max_tokens):
        live = [(inst, beam) for inst in instances for beam in inst.beams]
        if not live:
            break
        outputs = _run_one_step(engine, [(beam.tokens, inst.lora, inst.images)
                                         for inst, beam in live], step_params, counter)
        candidates: dict[int, list[BeamSearchSequence]] = {id(i): [] for i in instances}
        for (inst, beam), out in zip(live, outputs):
            logprobs = out.outputs[0].logprobs[0]
            for token_id, logprob in logprobs.items():
                new_beam = BeamSearchSequence(
                    tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [logprobs],
                    cum_logprob=beam.cum_logprob + logprob.logprob)
                if token_id == eos and not params.ignore_eos:
                    inst.completed.append(new_beam)
                else:
                    candidates[id(inst)].append(new_beam)
        for inst in instances:
            inst.beams = sorted(candidates[id(inst)], key=score, reverse=True)[:width]
    return [_finish(inst, engine, params, eos, score) for inst in instances]


def _run_one_step(engine: LLMEngine,
                  sequences: list[tuple[list[int], LoRARequest | None, list[ProcessedImage]]],
                  params: SamplingParams, counter: Iterator[int]) -> list[RequestOutput]:
    """One token (with logprobs) for every (sequence, its adapter, its images); outputs
    in input order."""
    req_ids = []
    try:
        for tokens, lora, images in sequences:
            req_id = f"beam-{next(counter)}"
            prompt: dict = {"prompt_token_ids": tokens}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            engine.add_request(req_id, prompt, params, lora_request=lora)
            req_ids.append(req_id)
    except Exception:
        engine.abort_request(req_ids)
        raise
    done: dict[str, RequestOutput] = {}
    while len(done) < len(req_ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[r] for r in req_ids]


def _finish(inst: _Instance, engine: LLMEngine, params: BeamSearchParams,
            eos: int | None, score) -> BeamSearchOutput:
    best = sorted(inst.completed + inst.beams, key=score, reverse=True)[:params.beam_width]
    tokenizer = engine.get_tokenizer()
    for beam in best:
        ends_with_eos = eos is not None and beam.tokens[-1] == eos and not params.ignore_eos
        beam.finish_reason = "stop" if ends_with_eos else "length"
        generated = beam.tokens[inst.num_prompt_tokens:]
        if ends_with_eos and not params.include_stop_str_in_output:
            generated = generated[:-1]
        beam.text = tokenizer.decode(generated) if tokenizer is not None else None
    return BeamSearchOutput(sequences=best)
