"""LLaVA (images in prompts) against transformers, and the engine's rules for images:
outputs independent of batching, chunked prefill (a chunk may end inside an image's
placeholder run), preemption and prefix caching, which must never serve one image's K/V
to another image."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidRequestError
from pagedllm.mm_inputs import ProcessedImage, expand_image_tokens
from tests.utils import hf_llava_greedy, random_image, save_tiny_llava

TOKENS = 12
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
PROMPT = "USER: <image>\n w5 w7 w9 ASSISTANT:"
TWO_IMAGES = "USER: <image>\n w3 <image>\n w8 w1 ASSISTANT:"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return save_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def llm32(llava_dir):
    return LLM(model=str(llava_dir), dtype="float32", max_model_len=256)


def _image_prompt(text: str, *images) -> dict:
    return {"prompt": text, "multi_modal_data": {"image": list(images)}}


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("text,num_images", [(PROMPT, 1), (TWO_IMAGES, 2)])
def test_greedy_matches_transformers(llava_dir, llm32, text, num_images):
    images = [random_image(seed) for seed in range(num_images)]
    out = llm32.generate([_image_prompt(text, *images)], GREEDY, use_tqdm=False)[0]
    # Each image token became its 16-token run (28 px / 7 px patches, class token dropped).
    assert len(out.prompt_token_ids) == len(llm32.get_tokenizer().encode(text)) \
        + num_images * 15
    assert out.outputs[0].token_ids == hf_llava_greedy(llava_dir, out.prompt_token_ids,
                                                       images, TOKENS)


def test_full_strategy_and_several_feature_layers(tmp_path):
    """The class token kept ("full": 17 rows an image) and two CLIP layers concatenated."""
    path = save_tiny_llava(tmp_path, seed=3, strategy="full", feature_layer=[-3, -1])
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    image = random_image(5, width=60, height=20)
    out = llm.generate([_image_prompt(PROMPT, image)], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids.count(llm.llm_engine.config.model.image_token_id) == 17
    assert out.outputs[0].token_ids == hf_llava_greedy(path, out.prompt_token_ids, [image],
                                                       TOKENS)


def test_images_change_the_output(llm32):
    """The pixels reach the decoder (the same ids with another image differ)."""
    a, b = (llm32.generate([_image_prompt(PROMPT, random_image(s))], GREEDY,
                           use_tqdm=False)[0] for s in (0, 1))
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def _prompts():
    return [_image_prompt(PROMPT, random_image(0)), _image_prompt(PROMPT, random_image(1)),
            _image_prompt(TWO_IMAGES, random_image(2), random_image(0)),
            {"prompt": "USER: w4 w4 w2 ASSISTANT:"}]


def _run_alone(llm, prompts, params):
    return [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batching_chunking_and_prefix_caching_do_not_change_outputs(llava_dir, dtype):
    """Alone, in one batch, in 5-token chunks (chunks end inside the 16-token runs),
    and from a warm prefix cache (the same text with other images must miss it): the
    same tokens and logprobs, bit for bit."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    alone_llm = LLM(model=str(llava_dir), dtype=dtype, max_model_len=256,
                    enable_prefix_caching=False)
    alone = _run_alone(alone_llm, _prompts(), params)
    chunked = LLM(model=str(llava_dir), dtype=dtype, max_model_len=256,
                  max_num_batched_tokens=5, max_num_seqs=4)
    for run in range(2):  # the second run's prompts hit the prefix cache
        batched = chunked.generate(_prompts(), params, use_tqdm=False)
        for a, b in zip(alone, batched):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [{t: lp.logprob for t, lp in step.items()} for step in a.outputs[0].logprobs] \
                == [{t: lp.logprob for t, lp in step.items()} for step in b.outputs[0].logprobs]
        if run == 1:  # (the text prompt is shorter than a block)
            assert all(o.num_cached_tokens >= 16 for o in batched[:3])


def test_prefix_cache_keys_include_the_image(llava_dir):
    """Two requests whose ids are equal but whose images differ share only the blocks
    before the image; one image's K/V never answers another's prompt."""
    llm = LLM(model=str(llava_dir), dtype="float32", max_model_len=256, block_size=4)
    first = llm.generate([_image_prompt(PROMPT, random_image(0))], GREEDY, use_tqdm=False)[0]
    other = llm.generate([_image_prompt(PROMPT, random_image(1))], GREEDY, use_tqdm=False)[0]
    again = llm.generate([_image_prompt(PROMPT, random_image(1))], GREEDY, use_tqdm=False)[0]
    # "USER:" is the only token before the image: no full block in common.
    assert other.num_cached_tokens == 0
    assert again.num_cached_tokens >= 16
    fresh = LLM(model=str(llava_dir), dtype="float32", max_model_len=256,
                enable_prefix_caching=False)
    expect = fresh.generate([_image_prompt(PROMPT, random_image(1))], GREEDY,
                            use_tqdm=False)[0]
    assert other.outputs[0].token_ids == again.outputs[0].token_ids \
        == expect.outputs[0].token_ids
    assert first.outputs[0].token_ids != other.outputs[0].token_ids


def test_preemption_recomputes_images(llava_dir):
    """A cache too small for every request at once: preempted requests encode their
    images again and end with the tokens they would get alone."""
    prompts = _prompts()[:3]
    llm = LLM(model=str(llava_dir), dtype="float32", max_model_len=128, block_size=4,
              num_kv_blocks=24, enable_prefix_caching=False)
    alone = _run_alone(llm, prompts, GREEDY)
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in together] == \
        [o.outputs[0].token_ids for o in alone]


def test_chat_with_image_parts(llm32):
    """LLM.chat reads image_pil and image_url (data URL) parts; the template writes the
    placeholder; the reply is the one of the same prompt through generate."""
    image = random_image(4)
    url_chat = [{"role": "user", "content": [{"type": "image_url",
                                              "image_url": {"url": _data_url(image)}},
                                             {"type": "text", "text": "w5 w7"}]}]
    pil_chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "w5 w7"}]}]
    url_out, pil_out = llm32.chat([url_chat, pil_chat], GREEDY, use_tqdm=False)
    assert url_out.prompt == "USER: <image>\nw5 w7 ASSISTANT:"
    direct = llm32.generate([_image_prompt(url_out.prompt, image)], GREEDY,
                            use_tqdm=False)[0]
    assert url_out.outputs[0].token_ids == pil_out.outputs[0].token_ids \
        == direct.outputs[0].token_ids
    text_only = llm32.chat([{"role": "user", "content": "w5 w7"}], GREEDY, use_tqdm=False)
    assert text_only[0].prompt == "USER: w5 w7 ASSISTANT:"


def test_token_id_prompts_and_preprocessed_pixels(llm32):
    """Ids with one placeholder or the run already expanded, PIL or preprocessed pixels:
    the same request."""
    image = random_image(6)
    ids = llm32.get_tokenizer().encode(PROMPT)
    image_id = llm32.llm_engine.config.model.image_token_id
    expanded, _ = expand_image_tokens(ids, image_id, 1, 16)
    pixels = llm32.llm_engine.input_processor.images.preprocess([image])[0]
    outs = llm32.generate([
        {"prompt_token_ids": ids, "multi_modal_data": {"image": image}},
        {"prompt_token_ids": expanded, "multi_modal_data": {"image": [image]}},
        {"prompt_token_ids": ids, "multi_modal_data": {"image": pixels}},
        _image_prompt(PROMPT, np.asarray(image))], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert len({tuple(o.prompt_token_ids) for o in outs}) == 1


@pytest.mark.parametrize("prompt,match", [
    ({"prompt": "USER: w5", "multi_modal_data": {"image": "x"}}, "0 image placeholder"),
    ({"prompt": "USER: <image> <image> w5"}, "2 image placeholder"),
    ({"prompt": "USER: <image> w5", "multi_modal_data": {"video": [1]}}, "'video'"),
    ({"prompt": "USER: <image> w5", "multi_modal_data": [1]}, "must be a dict"),
    ({"prompt": "USER: <image> w5", "multi_modal_data": {"image": "not an image"}},
     "PIL image or a numpy"),
    ({"prompt": "USER: <image> w5", "multi_modal_data": {"image": np.zeros((4, 4))}},
     "PIL image or a numpy"),
    ({"prompt": "USER: <image> w5",
      "multi_modal_data": {"image": ProcessedImage(np.zeros((3, 5, 5), np.float32))}},
     "shape"),
    ({"prompt": "USER: <image> w5", "multi_modal_data": {
        "image": ProcessedImage(np.full((3, 28, 28), np.nan, np.float32))}}, "finite"),
    ({"prompt": "<image> " * 5, "multi_modal_data": {"image": [random_image(0)] * 5}},
     "at most 4"),
])
def test_bad_image_prompts_are_refused(llm32, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm32.generate([prompt], GREEDY, use_tqdm=False)
    # The engine still serves.
    assert llm32.generate([_image_prompt(PROMPT, random_image(0))], GREEDY,
                          use_tqdm=False)[0].outputs[0].token_ids


def test_truncation_and_length_with_images(llava_dir):
    llm = LLM(model=str(llava_dir), dtype="float32", max_model_len=24)
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens cannot"):
        llm.generate([_image_prompt(PROMPT, random_image(0))],
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=8), use_tqdm=False)
    # Two images make 37 tokens: past max_model_len once expanded.
    with pytest.raises(InvalidRequestError, match="longer than the maximum model length"):
        llm.generate([_image_prompt(TWO_IMAGES, random_image(0), random_image(1))],
                     GREEDY, use_tqdm=False)


def test_images_refused_by_text_models_and_embeddings(tmp_path, llm32):
    from pagedllm import PoolingParams
    from tests.utils import save_tiny_model, tiny_llama_config

    text_model = LLM(model=str(save_tiny_model(tmp_path, tiny_llama_config())),
                     dtype="float32", skip_tokenizer_init=True)
    with pytest.raises(InvalidRequestError, match="does not take images"):
        text_model.generate([{"prompt_token_ids": [1, 2],
                              "multi_modal_data": {"image": random_image(0)}}], GREEDY)
    with pytest.raises(InvalidRequestError, match="images in embedding"):
        llm32.embed([_image_prompt(PROMPT, random_image(0))], PoolingParams())


def test_limit_and_unsupported_options(llava_dir):
    llm = LLM(model=str(llava_dir), dtype="float32", max_model_len=256,
              limit_mm_per_prompt={"image": 1})
    with pytest.raises(InvalidRequestError, match="at most 1"):
        llm.generate([_image_prompt(TWO_IMAGES, random_image(0), random_image(1))], GREEDY)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(model=str(llava_dir), limit_mm_per_prompt={"video": 1})
    with pytest.raises(ValueError, match="does not run with a draft model"):
        LLM(model=str(llava_dir), speculative_config={"model": str(llava_dir),
                                                      "num_speculative_tokens": 2})


def test_language_model_only(llava_dir, llm32):
    """vLLM's --language-model-only: the vision encoder is neither built nor loaded, a
    text prompt gives the whole model's tokens, and images are refused by name."""
    from pagedllm.models.llava import LlavaForConditionalGeneration

    llm = LLM(model=str(llava_dir), dtype="float32", max_model_len=256,
              language_model_only=True)
    model = llm.llm_engine.engine_core.executor.runner.model
    assert isinstance(model, LlavaForConditionalGeneration)
    assert model.vision_tower is None and model.multi_modal_projector is None
    full = llm32.llm_engine.engine_core.executor.runner.model
    params = sum(p.numel() for p in model.parameters())
    assert params < sum(p.numel() for p in full.parameters()) - sum(
        p.numel() for p in full.vision_tower.parameters())
    text = "USER: w5 w7 w9 ASSISTANT:"
    assert (llm.generate([text], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            == llm32.generate([text], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    with pytest.raises(InvalidRequestError, match="--language-model-only"):
        llm.generate([_image_prompt(PROMPT, random_image(0))], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.shutdown()


def test_mm_processor_kwargs(llava_dir, llm32):
    """vLLM's mm_processor_kwargs: the image processor's settings over its file's (its
    pixels then those of transformers' processor so set); unknown settings and an
    output size the vision tower cannot take are refused at start-up."""
    from transformers import AutoImageProcessor

    image = random_image(2)
    llm = LLM(model=str(llava_dir), dtype="float32", max_model_len=256,
              mm_processor_kwargs={"do_normalize": False})
    ours = llm.llm_engine.input_processor.images.pixels([image])[0]
    want = AutoImageProcessor.from_pretrained(llava_dir, backend="pil", do_normalize=False)(
        images=[image], return_tensors="np")["pixel_values"][0]
    np.testing.assert_array_equal(ours, want)
    default = llm32.llm_engine.input_processor.images.pixels([image])[0]
    assert not np.array_equal(ours, default)
    out = llm.generate([_image_prompt(PROMPT, image)], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == TOKENS
    llm.shutdown()
    for kwargs, match in [({"frobnicate": 1}, "no setting 'frobnicate'"),
                          ({"crop_size": {"height": 14, "width": 14}}, "vision tower takes")]:
        with pytest.raises(ValueError, match=match):
            LLM(model=str(llava_dir), dtype="float32", max_model_len=256,
                mm_processor_kwargs=kwargs)


def test_beam_search_with_images(llm32):
    """Every beam's step carries the prompt's images: width 1 is greedy decoding."""
    from pagedllm.sampling_params import BeamSearchParams

    prompt = _image_prompt(PROMPT, random_image(2))
    greedy = llm32.generate([prompt], GREEDY, use_tqdm=False)[0]
    beams = llm32.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=TOKENS,
                                                         ignore_eos=True))
    best = beams[0].sequences[0]
    assert best.tokens[len(greedy.prompt_token_ids):] == greedy.outputs[0].token_ids
    wide = llm32.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4))
    assert len(wide[0].sequences) == 3



@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}])
def test_parallel(llava_dir, llm32, parallel):
    """Two worker processes: under TP the decoder sharded and the vision tower whole on
    each rank (each encodes the step's images), under PP the first stage encoding them
    and embedding the prompt; the same tokens as one worker."""
    prompts = _prompts()[:3]
    expect = llm32.generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(model=str(llava_dir), dtype="float32", max_model_len=256,
              max_num_batched_tokens=7, **parallel)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expect]


def test_parallel_samples_keep_the_images(llm32):
    """n = 2: each sample is its own engine request, and each carries the images (greedy:
    both are the single sample's tokens, not the placeholders' without image rows)."""
    prompt = _image_prompt(PROMPT, random_image(3))
    one = llm32.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    two = llm32.generate([prompt], SamplingParams(n=2, max_tokens=TOKENS, temperature=0,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert [o.token_ids for o in two.outputs] == [one, one]


def test_image_processor_must_fit_the_vision_tower(tmp_path):
    """A processor that crops to another size than the tower's is the model's error,
    refused at start-up (not by the worker at the first image)."""
    import json

    from pagedllm.errors import ModelLoadError

    path = save_tiny_llava(tmp_path)
    config_file = path / "preprocessor_config.json"
    config = json.loads(config_file.read_text())
    config["crop_size"] = {"height": 21, "width": 21}
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="its vision tower takes 28 x 28"):
        LLM(model=str(path), dtype="float32")
