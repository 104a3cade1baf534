"""Async scheduling end to end (`async_scheduling=True`) on a tiny random Llama.

With async scheduling the engine schedules and launches step N + 1 before step N's
sampled tokens are back on the host; a request finished by step N's token (EOS, a stop
id, a stop string, an abort) has one extra token computed in N + 1, which is dropped.
None of that may show in the outputs: every test runs the same requests through an
engine with `async_scheduling=False` and one with `True` and wants identical token ids,
finish and stop reasons, and logprobs (the engine is batch invariant, so bit-identical).
On CPU the flag changes only the order of host work (no speed-up), which is how CI
covers the logic.

A recorder wrapped around the engine core's scheduler and executor checks that async
scheduling really overlaps steps (a step is scheduled while another is unapplied), that
synchronous scheduling never does, and that nothing overlaps while a request needs its
previous token on the host (a repetition penalty).
"""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from tests.utils import random_prompts, save_tiny_model, tiny_llama_config

VOCAB = 256
# A run that hangs (a request never scheduled again) fails instead of blocking CI.
TEST_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def _fail_instead_of_hanging():
    def on_alarm(signum, frame):
        raise TimeoutError(f"test still running after {TEST_TIMEOUT_S} s (engine hang?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_TIMEOUT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # Seed 5, as tests/engine/test_sampling.py: distributions flat enough that seeds
    # matter for random sampling.
    return save_tiny_model(tmp_path_factory.mktemp("tiny_async"),
                           tiny_llama_config(vocab_size=VOCAB), seed=5)


def make_llm(path, async_scheduling: bool, **kw) -> LLM:
    # CPU even on a GPU machine: exact equality needs batch-invariant kernels, and async
    # scheduling changes which requests share a step (a finished request's wasted token,
    # a preemption a step later). On an H200 four of these comparisons differed at
    # near-tied tokens of this flat tiny model; tests/cuda/test_cuda_graphs.py checks
    # async against sync scheduling on the GPU.
    kw.setdefault("device", "cpu")
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("block_size", 4)
    return LLM(str(path), dtype="float32", async_scheduling=async_scheduling, **kw)


class StepRecorder:
    """Wraps an LLM's engine-core scheduler and executor (instance attributes) to log,
    at each `schedule()`, how many launched non-empty steps were still unapplied (not
    yet through `update_from_output`) and whether a live request had a repetition
    penalty."""

    def __init__(self, llm: LLM) -> None:
        core = llm.llm_engine.engine_core
        sched, executor = core.scheduler, core.executor
        self.unapplied: set[int] = set()
        self.log: list[tuple[int, bool]] = []
        schedule, update, execute = (sched.schedule, sched.update_from_output,
                                     executor.execute_model)

        def recording_schedule():
            penalized = any(r.sampling_params.repetition_penalty != 1.0
                            for r in sched.requests.values())
            self.log.append((len(self.unapplied), penalized))
            return schedule()

        def recording_execute(so, *args, **kwargs):
            if not so.is_empty:
                self.unapplied.add(id(so))
            return execute(so, *args, **kwargs)

        def recording_update(so, runner_output):
            self.unapplied.discard(id(so))
            return update(so, runner_output)

        sched.schedule = recording_schedule
        sched.update_from_output = recording_update
        executor.execute_model = recording_execute

    def reset(self) -> None:
        self.log = []

    @property
    def max_overlap(self) -> int:
        """The most unapplied steps seen at a schedule() since the last reset()."""
        return max((n for n, _ in self.log), default=0)


@pytest.fixture(scope="module")
def llms(tiny_path):
    """{async_scheduling: (LLM, StepRecorder)}, shared by the tests of plain settings
    (their prefix caches see the same requests in the same order)."""
    out = {}
    for mode in (False, True):
        llm = make_llm(tiny_path, mode)
        out[mode] = (llm, StepRecorder(llm))
    return out


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def summarize(outputs) -> list:
    """Everything a user sees of each completion, in input order (logprob dicts as
    sorted tuples; request ids left out: each LLM numbers its own requests)."""
    result = []
    for out in outputs:
        for c in out.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [sorted((t, lp.logprob, lp.rank) for t, lp in d.items())
                            for d in c.logprobs]
            result.append((c.index, c.token_ids, c.finish_reason,
                           c.stop_reason, logprobs, c.cumulative_logprob, c.text))
    return result


def generate_both(llms, prompts, params) -> tuple[list, list]:
    """The outputs of the sync and the async engine (recorders reset first)."""
    results = []
    for mode in (False, True):
        llm, recorder = llms[mode]
        recorder.reset()
        results.append(llm.generate(token_prompts(prompts), params, use_tqdm=False))
    return results[0], results[1]


def assert_all_blocks_free(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    assert core.scheduler.kv_cache_manager.get_num_free_blocks() == core.num_blocks - 1
    assert not core.scheduler.requests and not core.has_unfinished_requests()


# ------------------------------------------------------------------------------ tests


def test_greedy_batch_matches_sync_and_overlaps(llms):
    """Greedy prompts of different lengths and max_tokens (1 to 12, some with logprobs):
    identical tokens, finish reasons and logprobs. The async engine really scheduled
    steps while another was unapplied; the sync engine never did; every block is free
    afterwards."""
    prompts = random_prompts(6, VOCAB, 3, 30, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=m, logprobs=lp)
              for m, lp in zip((1, 2, 3, 5, 8, 12), (None, 2, None, 0, 3, None))]
    sync, async_ = generate_both(llms, prompts, params)
    assert summarize(async_) == summarize(sync)
    assert [len(o.outputs[0].token_ids) for o in sync] == [1, 2, 3, 5, 8, 12]
    assert all(o.outputs[0].finish_reason == "length" for o in sync)
    assert llms[True][0].llm_engine.config.scheduler.async_scheduling is True
    assert llms[False][0].llm_engine.config.scheduler.async_scheduling is False
    assert llms[True][1].max_overlap >= 1
    assert llms[False][1].max_overlap == 0
    for mode in (False, True):
        assert_all_blocks_free(llms[mode][0])


def test_stop_token_ids_mid_run_match_sync(llms):
    """Each request stops on a stop token id its greedy run produces mid-way (found by a
    first synchronous run), while its batch-mates go on: the async engine computed one
    token past each stop and must drop it. Same tokens, finish reason "stop" and stop
    reason in both modes."""
    prompts = random_prompts(5, VOCAB, 4, 24, seed=12)
    free_run = llms[False][0].generate(token_prompts(prompts),
                                       SamplingParams(temperature=0, max_tokens=12),
                                       use_tqdm=False)
    params, stop_lengths = [], []
    for i, out in enumerate(free_run):
        tokens = out.outputs[0].token_ids
        # The first token from index 1 + i on that did not occur before it: the request
        # stops right there, at different steps for different requests.
        index = next((j for j in range(1 + i, 12) if tokens[j] not in tokens[:j]), None)
        if i == 4 or index is None:  # no stop id: runs on past the others
            params.append(SamplingParams(temperature=0, max_tokens=16, logprobs=1))
            stop_lengths.append(None)
        else:
            params.append(SamplingParams(temperature=0, max_tokens=12,
                                         stop_token_ids=[tokens[index]], logprobs=1))
            stop_lengths.append(index + 1)
    assert sum(n is not None for n in stop_lengths) >= 3
    sync, async_ = generate_both(llms, prompts, params)
    assert summarize(async_) == summarize(sync)
    for out, length in zip(sync, stop_lengths):
        completion = out.outputs[0]
        if length is not None:
            assert completion.finish_reason == "stop" and len(completion.token_ids) == length
            assert completion.stop_reason == completion.token_ids[-1]
    assert llms[True][1].max_overlap >= 1
    for mode in (False, True):
        assert_all_blocks_free(llms[mode][0])


@pytest.fixture(scope="module")
def eos_path(tiny_path, llms, tmp_path_factory):
    """The tiny model with an EOS id: the token its greedy run of EOS_PROMPT produces
    as its 5th output (so that request ends on EOS mid-way)."""
    out = llms[False][0].generate(token_prompts([EOS_PROMPT]),
                       SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    eos = out[0].outputs[0].token_ids[4]
    path = tmp_path_factory.mktemp("tiny_async_eos") / "model"
    shutil.copytree(tiny_path, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    return path, eos


EOS_PROMPT = random_prompts(1, VOCAB, 9, 9, seed=13)[0]


def test_eos_matches_sync(eos_path):
    """A model with an EOS id: a request that stops on EOS mid-run, one that ignores EOS,
    one whose EOS is masked by min_tokens (which also turns overlap off while it
    runs), and random other prompts: identical outputs in both modes."""
    path, eos = eos_path
    prompts = [EOS_PROMPT] + random_prompts(3, VOCAB, 4, 20, seed=14)
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=6),
              SamplingParams(temperature=0, max_tokens=10)]
    results = {}
    for mode in (False, True):
        llm = make_llm(path, mode)
        assert llm.llm_engine.input_processor.eos_token_id == eos
        results[mode] = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert_all_blocks_free(llm)
    assert summarize(results[True]) == summarize(results[False])
    first = results[False][0].outputs[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == eos
    assert len(first.token_ids) <= 5


def test_seeded_sampling_and_n_match_sync(llms):
    """Seeded random sampling (temperature 0.8, one seed per request, top-p / top-k on
    some) and n=3 samples of one prompt: the per-request generators give identical
    tokens and logprobs in both modes (the extra token computed for a stopped request
    must not disturb anyone's generator)."""
    prompts = random_prompts(5, VOCAB, 4, 30, seed=15)
    params = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=10, logprobs=2)
              for i in range(3)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7,
                                 max_tokens=8))
    params.append(SamplingParams(n=3, temperature=0.8, seed=21, max_tokens=9, logprobs=1))
    sync, async_ = generate_both(llms, prompts, params)
    assert summarize(async_) == summarize(sync)
    assert len(sync[4].outputs) == 3
    assert len({tuple(c.token_ids) for c in sync[4].outputs}) > 1  # really random
    assert llms[True][1].max_overlap >= 1
    # Seeded, with an early stop on a sampled token: the dropped extra token is sampled
    # from the request's own generator, which must not leak into anything observable.
    stop_id = sync[0].outputs[0].token_ids[3]
    stopping = [SamplingParams(temperature=0.8, seed=100, max_tokens=10,
                               stop_token_ids=[stop_id]),
                SamplingParams(temperature=0.8, seed=101, max_tokens=10)]
    sync, async_ = generate_both(llms, prompts[:2], stopping)
    assert summarize(async_) == summarize(sync)
    assert sync[0].outputs[0].finish_reason == "stop"


def test_repetition_penalty_mix_waits_for_each_step(llms):
    """One request with a repetition penalty (its sampling reads its previous tokens on
    the host) among plain ones: outputs identical to sync; while it is live no step is
    scheduled with another unapplied, and overlap resumes once it has finished."""
    prompts = random_prompts(4, VOCAB, 4, 24, seed=16)
    params = [SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3,
                             logprobs=2),
              SamplingParams(temperature=0, max_tokens=14),
              SamplingParams(temperature=0.8, seed=3, max_tokens=14),
              SamplingParams(temperature=0, max_tokens=12, logprobs=1)]
    sync, async_ = generate_both(llms, prompts, params)
    assert summarize(async_) == summarize(sync)
    log = llms[True][1].log
    assert any(penalized for _, penalized in log)
    assert all(n == 0 for n, penalized in log if penalized)
    assert any(n >= 1 for n, penalized in log if not penalized)


def test_chunked_prefill_and_prefix_hits_match_sync(tiny_path):
    """12-token steps split prompts into chunks scheduled back to back while the previous
    chunk is in flight; the prompts share a 32-token prefix another request cached
    first (two full 16-token blocks). Then a follow-up turn whose prompt contains the
    first turn's outputs (prefix hits over K/V written from device-side tokens). Same
    tokens and cache hits in both modes."""
    shared = random_prompts(1, VOCAB, 32, 32, seed=7)[0]
    prompts = [shared + p for p in random_prompts(3, VOCAB, 1, 21, seed=1)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1)
    results = {}
    for mode in (False, True):
        llm = make_llm(tiny_path, mode, block_size=16, num_kv_blocks=48,
                       max_num_batched_tokens=12)
        llm.generate(token_prompts([shared + [1]]), params, use_tqdm=False)
        first = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        follow_ups = [p + o.outputs[0].token_ids + [3, 4, 5]
                      for p, o in zip(prompts, first)]
        second = llm.generate(token_prompts(follow_ups), params, use_tqdm=False)
        results[mode] = (first, second)
        assert [o.num_cached_tokens for o in first] == [32, 32, 32]
        assert all(o.num_cached_tokens >= 32 for o in second)
        assert_all_blocks_free(llm)
    assert summarize(results[True][0]) == summarize(results[False][0])
    assert summarize(results[True][1]) == summarize(results[False][1])


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preemption_matches_sync(tiny_path, preemption_mode):
    """24 usable 4-token blocks for 8 requests of up to 57 tokens (as in
    test_swap_preemption.py): the async engine preempts too (never a request in
    flight), and greedy and seeded outputs equal the sync engine's."""
    prompts = random_prompts(8, VOCAB, 3, 41, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=16, logprobs=1)] * 6
    params += [SamplingParams(temperature=0.8, seed=5, max_tokens=16),
               SamplingParams(temperature=0.8, seed=6, max_tokens=12)]
    kw = dict(block_size=4, num_kv_blocks=25, preemption_mode=preemption_mode)
    if preemption_mode == "swap":
        kw["swap_space"] = 0.01
    results = {}
    for mode in (False, True):
        llm = make_llm(tiny_path, mode, **kw)
        results[mode] = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        sched = llm.llm_engine.engine_core.scheduler
        assert sched.num_preemptions > 0, f"async_scheduling={mode}: no preemption"
        if preemption_mode == "swap":
            assert sched.num_swaps_out > 0 and sched.num_swaps_in == sched.num_swaps_out
            assert sched.num_swapped_blocks == 0
        assert_all_blocks_free(llm)
    assert summarize(results[True]) == summarize(results[False])


def test_abort_mid_run(llms):
    """Through LLMEngine: a request aborted while the async engine has a step in flight
    for it ends with "abort" and a prefix of its full output; its batch-mate's output
    is unaffected and equal in both modes; the cache is all free afterwards."""
    keep_prompt, drop_prompt = random_prompts(2, VOCAB, 5, 15, seed=17)
    full = llms[False][0].generate(token_prompts([drop_prompt]),
                                   SamplingParams(temperature=0, max_tokens=20),
                                   use_tqdm=False)[0].outputs[0].token_ids
    finals = {}
    for mode in (False, True):
        engine = llms[mode][0].llm_engine
        keep_id, drop_id = f"abort-keep-{mode}", f"abort-drop-{mode}"
        engine.add_request(keep_id, {"prompt_token_ids": keep_prompt},
                           SamplingParams(temperature=0, max_tokens=12, logprobs=1))
        engine.add_request(drop_id, {"prompt_token_ids": drop_prompt},
                           SamplingParams(temperature=0, max_tokens=20))
        latest = {}
        for _ in range(200):
            for out in engine.step():
                latest[out.request_id] = out
            if drop_id in latest and len(latest[drop_id].outputs[0].token_ids) >= 3:
                break
        (aborted,) = engine.abort_request(drop_id)
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        latest[drop_id] = aborted
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                latest[out.request_id] = out
        assert not engine.has_unfinished_requests()
        drop_tokens = latest[drop_id].outputs[0].token_ids
        assert 3 <= len(drop_tokens) < 20 and drop_tokens == full[:len(drop_tokens)]
        assert latest[keep_id].finished
        finals[mode] = latest[keep_id]
        assert_all_blocks_free(llms[mode][0])
    assert summarize([finals[True]]) == summarize([finals[False]])


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A word-level tokenizer of the tiny vocabulary: token i is the word "w{i}", and
    text is the words joined by spaces (stop strings without a real tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)},
                                         unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("word_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(path)
    return path


def test_stop_string_matches_sync(tiny_path, word_tokenizer):
    """A stop string that the greedy text reaches mid-run (found by a first sync run):
    the output processor finishes the request after the step that produced it, while
    the async engine already has the next step in flight. Same tokens, text, finish
    and stop reasons in both modes."""
    prompts = random_prompts(3, VOCAB, 4, 20, seed=18)
    llms_ = {mode: make_llm(tiny_path, mode, skip_tokenizer_init=False,
                            tokenizer=str(word_tokenizer)) for mode in (False, True)}
    free_run = llms_[False].generate(token_prompts(prompts[:1]),
                                     SamplingParams(temperature=0, max_tokens=12),
                                     use_tqdm=False)[0].outputs[0]
    stop = f"w{free_run.token_ids[4]}"
    params = [SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                             include_stop_str_in_output=True)]
    results = {mode: llm.generate(token_prompts(prompts), params, use_tqdm=False)
               for mode, llm in llms_.items()}
    assert summarize(results[True]) == summarize(results[False])
    first = results[False][0].outputs[0]
    assert first.finish_reason == "stop" and first.stop_reason == stop
    assert len(first.token_ids) <= 5
    for llm in llms_.values():
        assert_all_blocks_free(llm)


# ----------------------------------------------------------------- flag and resolution


def test_async_scheduling_rejects_speculative_decoding_and_parallelism(tiny_path):
    """async_scheduling=True with speculative decoding, tensor or pipeline parallelism
    is a ValueError naming async_scheduling (raised while resolving the config, before
    any worker starts); left unset (None) those setups just run without it."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(tiny_path), dtype="float32", skip_tokenizer_init=True,
            async_scheduling=True, speculative_config=ngram)
    for parallel in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        with pytest.raises(ValueError, match="async_scheduling"):
            EngineArgs(model=str(tiny_path), device="cpu", async_scheduling=True,
                       **parallel).create_engine_config()
        config = EngineArgs(model=str(tiny_path), device="cpu",
                            **parallel).create_engine_config()
        assert config.scheduler.async_scheduling is False
    config = EngineArgs(model=str(tiny_path), device="cpu",
                        speculative_config=ngram).create_engine_config()
    assert config.scheduler.async_scheduling is False
    config = EngineArgs(model=str(tiny_path), device="cpu", async_scheduling=False,
                        speculative_config=ngram).create_engine_config()
    assert config.scheduler.async_scheduling is False


def test_async_scheduling_resolution_on_cpu(tiny_path):
    """EngineArgs.async_scheduling defaults to None (auto), which is off on CPU;
    explicit True / False are kept (True works on CPU)."""
    assert EngineArgs().async_scheduling is None
    resolved = {value: EngineArgs(model=str(tiny_path), device="cpu",
                                  async_scheduling=value).create_engine_config()
                .scheduler.async_scheduling
                for value in (None, True, False)}
    assert resolved == {None: False, True: True, False: False}


def test_async_scheduling_cli_flag(tiny_path):
    """The CLI derives --async-scheduling / --no-async-scheduling from the EngineArgs
    field; neither leaves it None (auto)."""
    from pagedllm.entrypoints.cli import build_parser, engine_args_from

    def parsed(*flags):
        ns = build_parser().parse_args(["generate", str(tiny_path), *flags])
        return engine_args_from(ns).async_scheduling

    assert parsed("--async-scheduling") is True
    assert parsed("--no-async-scheduling") is False
    assert parsed() is None
