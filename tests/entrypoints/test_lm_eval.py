"""lm-evaluation-harness's `local-completions` model against the live server: a tiny local
multiple-choice task, no tokenizer set up by hand (lm-eval's default `tokenizer_backend`
"auto" finds /tokenizer_info and /tokenize and tokenizes through the server).

lm-eval scores each choice with one /v1/completions request per (context + choice) as
token ids, `echo: true, max_tokens: 1, logprobs: 1`, and sums `token_logprobs[ctxlen:-1]`.
Those sums are checked against the model's own log-softmax of the same tokens (an in-process
`LLM` with the server's settings, its model run directly, outside the scheduler and the
server's logprob plumbing), and acc against the choices those sums pick. (The model itself
matches transformers: tests/engine/test_smollm2.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.entrypoints.utils import MODEL_NAME, RemoteServer
from tests.utils import pagedllm_sequence_logprobs

SERVER_ARGS = ["--dtype", "float32", "--quantization", "none", "--max-model-len", "512",
               "--num-kv-blocks", "64", "--max-num-seqs", "16", "--log-stats-interval", "0"]
TASK = "pagedllm_tiny_mc"
# Questions a 135M model mostly gets right; choices without their leading space (lm-eval's
# target_delimiter " " puts it in front of each).
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"],
     "answer": 0},
    {"question": "The capital of Japan is", "choices": ["Madrid", "Tokyo", "Cairo"],
     "answer": 1},
    {"question": "One, two, three, four,", "choices": ["seven", "ten", "five"], "answer": 2},
    {"question": "The sun rises in the", "choices": ["east", "west"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Fahrenheit", "Celsius"],
     "answer": 1},
    {"question": "Monday, Tuesday,", "choices": ["Wednesday", "Friday", "Sunday"],
     "answer": 0},
]
# The same float32 kernels in both, batched differently: sums of a few token logprobs
# agree to ~1e-5.
ATOL = 1e-3


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """A task YAML and its JSONL, loaded by datasets' packaged `json` builder (no hub)."""
    root = tmp_path_factory.mktemp("lm_eval_task")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (root / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
  cache_dir: {json.dumps(str(root / "datasets_cache"))}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return root


@pytest.fixture(scope="module")
def reference():
    """The bundled model in-process, as the server runs it (dequantized, float32)."""
    from pagedllm import LLM

    return LLM(dtype="float32", quantization="none", max_model_len=512, num_kv_blocks=16)


def run_lm_eval(server: RemoteServer, task_dir: Path, **model_args) -> tuple[object, dict]:
    """(the lm-eval model, simple_evaluate's results) for the tiny task."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    # No `tokenizer` / `tokenizer_backend`: what a user types for a vLLM server.
    lm = get_model("local-completions").create_from_arg_obj(
        {"model": MODEL_NAME, "base_url": server.url + "/v1/completions", **model_args})
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[TASK], log_samples=True, bootstrap_iters=0,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    return lm, results


def reference_loglikelihood(reference, context: str, continuation: str,
                            ) -> tuple[float, bool]:
    """(sum of the continuation's logprobs, whether each of its tokens is the argmax),
    split into context / continuation tokens as lm-eval does (the whole string encoded,
    the context's own encoding length as the split)."""
    tokenizer = reference.get_tokenizer()
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctxlen = len(tokenizer(context, add_special_tokens=False).input_ids)
    logprobs = pagedllm_sequence_logprobs(reference, whole)
    rows = logprobs[torch.arange(ctxlen - 1, len(whole) - 1)]
    targets = torch.tensor(whole[ctxlen:])
    total = float(rows[torch.arange(len(targets)), targets].sum())
    return total, bool((rows.argmax(-1) == targets).all())


def test_local_completions_multiple_choice(monkeypatch, server, task_dir, reference):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lm, results = run_lm_eval(server, task_dir)
    # lm-eval found the server's tokenizer endpoints itself.
    assert lm.tokenizer_backend == "remote"

    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == DOCS
    correct = []
    for sample, doc in zip(samples, DOCS):
        assert [tuple(a) for a in sample["arguments"]] == [
            (doc["question"], " " + choice) for choice in doc["choices"]]
        lls = [resp[0] for resp in sample["resps"]]  # [(loglikelihood, is_greedy)] per choice
        for (ll, greedy), (context, continuation) in zip(lls, sample["arguments"]):
            ref_ll, ref_greedy = reference_loglikelihood(reference, context, continuation)
            assert ll == pytest.approx(ref_ll, abs=ATOL), (context, continuation)
            assert greedy == ref_greedy, (context, continuation)
        best = max(range(len(lls)), key=lambda i: lls[i][0])
        correct.append(best == doc["answer"])
        assert sample["acc"] == float(correct[-1])

    acc = results["results"][TASK]["acc,none"]
    assert isinstance(acc, float) and acc == pytest.approx(sum(correct) / len(DOCS))
    # The model knows these (all six with this server); a broken scorer lands near chance.
    assert acc >= 4 / 6

    # Batched prompts (token-id lists in one request, choices matched back by `index`) and
    # concurrent requests: the same numbers.
    _, batched = run_lm_eval(server, task_dir, batch_size=4, num_concurrent=2)
    batched_samples = sorted(batched["samples"][TASK], key=lambda s: s["doc_id"])
    for one, many in zip(samples, batched_samples):
        assert [r[0][0] for r in many["resps"]] == pytest.approx(
            [r[0][0] for r in one["resps"]], abs=1e-4)
    assert batched["results"][TASK]["acc,none"] == acc
