"""Custom logits processors (pagedllm.logits_process): a request opts in through
extra_args, its function sees its output so far and changes only its own row (the other
requests' outputs are what they are without it, batched or not, preempted or not), bad
arguments are the request's error, and the options that cannot work with them are
refused. The server's flag and vllm_xargs: tests/entrypoints/test_server_options.py."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ConfigError
from pagedllm.logits_process import LogitsProcessor, resolve_logits_processors
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256


class ForceToken(LogitsProcessor):
    """extra_args {"force": id}: every token is that id."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        force = (params.extra_args or {}).get("force")
        if force is not None and not (isinstance(force, int) and 0 <= force < VOCAB):
            raise ValueError(f"force must be a token id, got {force!r}")

    def new_request(self, params, prompt_token_ids):
        force = (params.extra_args or {}).get("force")
        if force is None:
            return None

        def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            forced = torch.full_like(logits, float("-inf"))
            forced[force] = 0.0
            return forced  # a new row: the engine copies it in

        return apply


class NoRepeat(LogitsProcessor):
    """extra_args {"no_repeat": true}: a token of the output so far is never sampled
    again (in place)."""

    def new_request(self, params, prompt_token_ids):
        if not (params.extra_args or {}).get("no_repeat"):
            return None
        seen: list[list[int]] = []

        def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            seen.append(list(output_ids))
            if output_ids:
                logits[torch.tensor(output_ids)] = float("-inf")
            return logits

        apply.seen = seen  # type: ignore[attr-defined]
        return apply


class Faulty(LogitsProcessor):
    """extra_args {"fail": how}: "new_request" raises there, "step" raises once the
    request has 2 output tokens, "shape" returns a row of the wrong size."""

    def new_request(self, params, prompt_token_ids):
        how = (params.extra_args or {}).get("fail")
        if how is None:
            return None
        if how == "new_request":
            raise KeyError("no table for this prompt")

        def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if how == "shape":
                return logits[:10]
            if len(output_ids) == 2:
                raise ZeroDivisionError("step 2")
            return logits

        return apply


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_procs"),
                           tiny_llama_config(vocab_size=VOCAB), seed=3)


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
               logits_processors=[ForceToken, NoRepeat])


def _ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_requests_opt_in_and_others_are_untouched(tiny_path, llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, VOCAB, 4, 20, seed=2)]
    plain = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = _ids(plain.generate(prompts, greedy, use_tqdm=False))
    # Without extra_args the processors leave every request alone.
    assert _ids(llm.generate(prompts, greedy, use_tqdm=False)) == expected
    forced = SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True,
                            extra_args={"force": 7})
    no_repeat = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                               extra_args={"no_repeat": True})
    mixed = llm.generate(prompts, [greedy, forced, greedy, no_repeat, greedy],
                         use_tqdm=False)
    ids = _ids(mixed)
    assert ids[1] == [7] * 10
    assert len(set(ids[3])) == 10 and ids[3][0] == expected[3][0]
    # The other rows of the batch: as without processors.
    assert [ids[0], ids[2], ids[4]] == [expected[0], expected[2], expected[4]]
    # Logprobs stay the model's (the raw logits), as vLLM's.
    scored = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=3, logprobs=0,
                                                      extra_args={"force": 7}),
                          use_tqdm=False)[0].outputs[0]
    assert scored.token_ids == [7, 7, 7]
    assert all(step[7].logprob > -float("inf") for step in scored.logprobs)


def test_function_sees_the_output_so_far_even_after_preemption(tiny_path):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, VOCAB, 8, 20, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            extra_args={"no_repeat": True})
    roomy = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
                logits_processors=[NoRepeat])
    expected = _ids(roomy.generate(prompts, params, use_tqdm=False))
    assert all(len(set(ids)) == 16 for ids in expected)
    # Too few blocks for six: requests are preempted and rebuilt, their function anew.
    small = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
                num_kv_blocks=20, logits_processors=[NoRepeat])
    assert _ids(small.generate(prompts, params, use_tqdm=False)) == expected
    assert small.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_function_is_called_with_each_steps_output(tiny_path):
    procs = []

    class Recording(NoRepeat):
        def new_request(self, params, prompt_token_ids):
            fn = super().new_request(params, prompt_token_ids)
            procs.append((prompt_token_ids, fn))
            return fn

    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
              logits_processors=[Recording])
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                      extra_args={"no_repeat": True}), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    ((prompt, fn),) = procs
    assert prompt == [1, 2, 3]
    assert fn.seen == [ids[:i] for i in range(4)]


def test_a_processor_that_fails_fails_its_request_alone(tiny_path, caplog):
    """An exception in user code (in new_request, in a step's function, or a returned
    row of the wrong size) finishes that request as aborted, logged with the processor's
    name; the batch's other requests, and the engine, go on as without it."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, VOCAB, 4, 20, seed=8)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    expected = _ids(plain.generate(prompts, greedy, use_tqdm=False))
    llm = LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True, block_size=4,
              logits_processors=[Faulty])
    params = [greedy] + [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                        extra_args={"fail": how})
                         for how in ("new_request", "step", "shape")] + [greedy]
    with caplog.at_level("ERROR", logger="pagedllm.sample.sampler"):
        out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in out] == \
        ["length", "abort", "abort", "abort", "length"]
    ids = _ids(out)
    assert [ids[0], ids[4]] == [expected[0], expected[4]]
    # Failed at their first sampled token, or at the third (the two before stand).
    assert ids[1] == ids[3] == [] and ids[2] == expected[2][:2]
    for fragment in ("KeyError", "ZeroDivisionError: step 2",
                     "returned a tensor of shape (10,), not a logits row of shape (256,)"):
        assert fragment in caplog.text
    assert "custom logits processor Faulty failed" in caplog.text
    # The engine goes on.
    assert _ids(llm.generate(prompts[:2], greedy, use_tqdm=False)) == expected[:2]


def test_bad_arguments_are_the_requests_error(llm):
    with pytest.raises(ValueError, match="ForceToken: force must be a token id, got 'x'"):
        llm.generate([{"prompt_token_ids": [1, 2]}],
                     SamplingParams(max_tokens=2, extra_args={"force": "x"}), use_tqdm=False)
    with pytest.raises(ValueError, match="extra_args must be a dict with string keys"):
        SamplingParams(extra_args={1: 2})


def test_what_cannot_run_with_processors_is_refused(tiny_path):
    with pytest.raises(ConfigError, match="speculative decoding"):
        LLM(str(tiny_path), skip_tokenizer_init=True, logits_processors=[ForceToken],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="async_scheduling is not supported with logits"):
        LLM(str(tiny_path), skip_tokenizer_init=True, logits_processors=[ForceToken],
            async_scheduling=True)


def test_processors_are_named_by_class_or_qualified_name():
    name = "tests.engine.test_logits_processors"
    assert resolve_logits_processors([f"{name}:ForceToken", f"{name}.NoRepeat", ForceToken]) \
        == (ForceToken, NoRepeat, ForceToken)
    for spec, fragment in ((f"{name}:Missing", "has no 'Missing'"),
                           ("no_such_module_xyz:Cls", "cannot import 'no_such_module_xyz'"),
                           ("NoDots", "not a qualified class name"),
                           (f"{name}:VOCAB", "not a subclass"), (int, "not a subclass")):
        with pytest.raises(ConfigError, match=fragment):
            resolve_logits_processors([spec])
