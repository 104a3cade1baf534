"""Stop strings (split across tokens, streamed without leaking), incremental
detokenization of multi-byte and byte-fallback tokens, bad words."""

from __future__ import annotations

import pytest

from pagedllm import LLMEngine, RequestOutputKind, SamplingParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.output_processor import OutputProcessor, find_stop_string
from pagedllm.request import Request, RequestStatus

TEXT = "Hello world, this is a test of stop strings."


def test_find_stop_string_only_in_the_new_tail():
    assert find_stop_string("abcdef", 2, ["cde"]) == ("cde", 2)  # straddles old/new
    assert find_stop_string("abcdef", 1, ["cd"]) is None  # ended before the new text
    assert find_stop_string("abcdef", 3, ["ef", "de"]) == ("de", 3)  # earliest wins


def test_find_stop_string_equals_a_scan_of_every_position():
    """Random texts over a 3-letter alphabet (stops overlap, repeat and straddle) against
    the definition: of the matches ending in the new characters, the earliest start,
    the first stop of the list on a tie."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 30)))
        new = rng.randint(1, max(1, len(text)))
        stops = ["".join(rng.choice("ab ") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 5))]
        expected = None
        for start in range(len(text)):
            for stop in stops:
                end = start + len(stop)
                if len(text) - new < end <= len(text) and text[start:end] == stop:
                    expected = (stop, start)
                    break
            if expected is not None:
                break
        assert find_stop_string(text, new, stops) == expected, (text, new, stops)


def stream(tokenizer, params: SamplingParams, text: str = TEXT, prompt: str = "Say:"):
    """Feed the tokens of `text` one per step through an OutputProcessor."""
    processor = OutputProcessor(tokenizer)
    request = Request("r", tokenizer.encode(prompt), params, eos_token_id=None)
    request.status = RequestStatus.RUNNING
    processor.add_request(request, prompt)
    outputs = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        request.append_output_token_ids([token_id])
        outputs += processor.process([request])
        if processor.take_reqs_to_stop():
            assert outputs[-1].finished
            break
    return outputs


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stop_string_across_tokens_streams_without_leaking(smollm2_tokenizer, include, kind):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert "ld, th" not in pieces and "ld," not in pieces  # it spans three tokens
    params = SamplingParams(stop=["ld, th", "zzz-never"], include_stop_str_in_output=include,
                            output_kind=kind)
    outputs = stream(tok, params)
    expected = "Hello world, th" if include else "Hello wor"
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "ld, th"
    texts = [o.outputs[0].text for o in outputs]
    if kind == RequestOutputKind.DELTA:
        assert "".join(texts) == expected
    else:
        assert texts[-1] == expected
        assert all(expected.startswith(t) for t in texts)
    # Nothing streamed before the end goes past the cut (held back: len(stop) - 1).
    sent = ""
    for out in outputs[:-1]:
        sent = sent + out.outputs[0].text if kind == RequestOutputKind.DELTA else \
            out.outputs[0].text
        assert expected.startswith(sent) and len(sent) <= len(expected)


def test_stop_string_waits_for_min_tokens(smollm2_tokenizer):
    # "Hello" is complete after token 1 < min_tokens: not a stop; later text has none.
    outputs = stream(smollm2_tokenizer, SamplingParams(stop=["Hello"], min_tokens=3))
    assert not outputs[-1].finished
    assert outputs[-1].outputs[0].text == TEXT[:-4]  # len("Hello") - 1 held back


def byte_fallback_tokenizer():
    """A sentencepiece-style BPE: ▁ word marks, <0xNN> byte tokens for unknown chars."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{i:02X}>": 3 + i for i in range(256)})
    for ch in "▁abcdefghijklmnopqrstuvwxyz,.!":
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in ["▁hello", "▁world", "▁the", "▁a"]:
        piece = word[0]
        for ch in word[1:]:
            merges.append((piece, ch))
            piece += ch
            vocab.setdefault(piece, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                              byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                          normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("which", ["byte_fallback", "smollm2"])
def test_incremental_detokenization_matches_full_decode(smollm2_tokenizer, which):
    tok = byte_fallback_tokenizer() if which == "byte_fallback" else smollm2_tokenizer
    prompt = tok.encode("hello the world", add_special_tokens=False)
    output = tok.encode(" 世界 a 🎉🎉 hello! ünï ça 日本語 world.", add_special_tokens=False)
    if which == "byte_fallback":
        assert sum(t < 259 for t in output) > 10  # mostly <0xNN> byte tokens
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add_tokens([t]) for t in output]
    assert "\ufffd" not in "".join(deltas)  # never half a character
    full = tok.decode(prompt + output)
    assert detok.text == full[len(tok.decode(prompt)):]
    assert "".join(deltas) == detok.text


def test_stop_string_end_to_end_finishes_in_the_scheduler(default_llm):
    engine: LLMEngine = default_llm.llm_engine
    prompt = "The capital of France is"
    base = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True), use_tqdm=False)[0]
    tok = default_llm.get_tokenizer()
    ids = base.outputs[0].token_ids
    # A stop string across the boundary of tokens 4 and 5 (2 chars each side).
    cut = len(tok.decode(ids[:5]))
    text = base.outputs[0].text
    stop = text[cut - 2:cut + 2]
    assert len(stop) == 4 and text.find(stop) == cut - 2
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("stop-e2e", prompt, params)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert "".join(d.outputs[0].text for d in deltas) == text[:cut - 2]
    final = deltas[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert deltas[-1].finished
    assert sum(len(d.outputs[0].token_ids) for d in deltas) < 12  # stopped early
    kv = engine.engine_core.scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == engine.engine_core.num_blocks - 1


def test_bad_words_end_to_end(default_llm):
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=6)
    plain = default_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in plain
    banned = SamplingParams(temperature=0, max_tokens=6, bad_words=["Paris"])
    text = default_llm.generate([prompt], banned, use_tqdm=False)[0].outputs[0].text
    assert "Paris" not in text
