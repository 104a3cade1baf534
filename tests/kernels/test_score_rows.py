"""score_logprobs's native path (cpu_ops.score_rows) against torch's log-softmax, gather,
rank and topk (gather_logprobs): the same chosen and top-k entries, ranks exact where
logits lie on a grid (ties everywhere, none made or broken by rounding), odd vocabulary
sizes, masked tokens, rows torch must take, and each row's result alone == batched."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu.build import load_cpu_kernels
from pagedllm.sample import logprobs as logprobs_mod
from pagedllm.sample.logprobs import MAX_NATIVE_TOP_K, gather_logprobs, score_logprobs

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="needs the CPU kernels")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _reference(x: torch.Tensor, targets: torch.Tensor, k: int):
    return gather_logprobs(torch.log_softmax(x.float(), dim=-1), targets, min(k, x.shape[1]))


def _grid(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits that are multiples of 1/8 in [-12, 12]: exact in every dtype, and their
    logprobs keep the order and the ties of the logits."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-96, 97, (rows, vocab), generator=g) / 8).to(dtype)


def _check(got, ref, x: torch.Tensor, k: int) -> None:
    """Same chosen column, top-k of the same values (torch's order of ties aside; ours
    by smaller id), ranks exact, logprobs to float32 rounding."""
    assert torch.equal(got.token_ids[:, 0], ref.token_ids[:, 0])
    assert torch.equal(got.ranks, ref.ranks)
    values = x.float().gather(1, got.token_ids[:, 1:])
    assert torch.equal(values, x.float().gather(1, ref.token_ids[:, 1:]))
    for row_values, row_ids in zip(values.tolist(), got.token_ids[:, 1:].tolist()):
        keys = [(-v, i) for v, i in zip(row_values, row_ids)]
        assert keys == sorted(keys)  # most likely first, ties by id
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    assert got.token_ids.shape == ref.token_ids.shape == (x.shape[0], min(k, x.shape[1]) + 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 255, 257, 1000, 50001])
def test_native_scores_match_torch_on_ties(dtype, vocab):
    x = _grid(6, vocab, dtype, seed=vocab)
    targets = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(1))
    targets[0] = x[0].float().argmax()  # a greedy token: rank 1 whatever its ties
    for k in (0, 1, 5, 20, MAX_NATIVE_TOP_K):
        got = score_logprobs(x, targets, k)
        _check(got, _reference(x, targets, k), x, k)
    assert score_logprobs(x, targets, 0).ranks[0, 0] == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_scores_of_real_valued_logits(dtype):
    """Random logits: logprobs to float32 rounding; the top-k are the k largest."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(16, 49152, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 49152, (16,), generator=g)
    got, ref = score_logprobs(x, targets, 20), _reference(x, targets, 20)
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-5)
    assert torch.equal(got.token_ids[:, 0], targets)
    assert torch.equal(x.float().gather(1, got.token_ids[:, 1:]),
                       x.float().topk(20, dim=-1).values)


def test_masked_tokens_and_rows_torch_takes():
    x = _grid(5, 300, torch.float32, seed=7)
    x[0, ::2] = float("-inf")  # masked tokens: -inf logprobs, never counted above
    x[1, 5:] = float("-inf")  # fewer finite tokens than k: the top-k ends in -inf ones
    x[2, 17] = float("nan")  # torch's answer for these three rows
    x[3] = float("-inf")
    x[4, 3] = float("inf")
    targets = torch.tensor([0, 2, 17, 4, 3])
    got, ref = score_logprobs(x, targets, 8), _reference(x, targets, 8)
    for row in (0,):
        assert torch.equal(got.ranks[row], ref.ranks[row])
        torch.testing.assert_close(got.logprobs[row], ref.logprobs[row], rtol=0, atol=1e-5)
    assert got.logprobs[0, 0] == float("-inf")  # token 0 is masked
    assert torch.equal(got.logprobs[1, 6:], ref.logprobs[1, 6:])  # -inf
    assert torch.equal(got.ranks[1], ref.ranks[1])
    torch.testing.assert_close(got.logprobs[1], ref.logprobs[1], rtol=0, atol=1e-5)
    for row in (2, 3, 4):  # torch's path, exactly
        assert torch.equal(got.token_ids[row], ref.token_ids[row])
        assert torch.equal(got.ranks[row], ref.ranks[row])
        torch.testing.assert_close(got.logprobs[row], ref.logprobs[row], rtol=0, atol=0,
                                   equal_nan=True)


def test_a_rows_scores_do_not_depend_on_the_batch():
    x = (torch.randn(9, 4099, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    targets = torch.arange(9) * 400
    batched = score_logprobs(x, targets, 12)
    for i in range(9):
        alone = score_logprobs(x[i:i + 1], targets[i:i + 1], 12)
        for field in ("token_ids", "logprobs", "ranks"):
            assert torch.equal(getattr(alone, field)[0], getattr(batched, field)[i])


def test_large_k_and_other_layouts_take_torch(monkeypatch):
    called = []
    real = logprobs_mod.cpu_ops.score_rows
    monkeypatch.setattr(logprobs_mod.cpu_ops, "score_rows",
                        lambda *a: called.append(a[-1]) or real(*a))
    x = _grid(3, 200, torch.float32, seed=2)
    targets = torch.tensor([1, 2, 3])
    big = score_logprobs(x, targets, MAX_NATIVE_TOP_K + 1)
    ref = _reference(x, targets, MAX_NATIVE_TOP_K + 1)
    assert all(torch.equal(getattr(big, f), getattr(ref, f))
               for f in ("token_ids", "logprobs", "ranks"))
    score_logprobs(x.t().contiguous().t(), targets, 3)  # columns not contiguous
    assert called == []
    small = _grid(3, 40, torch.float32, seed=3)
    got = score_logprobs(small, targets, 500)  # k past the vocabulary: all 40, natively
    assert called == [40]
    _check(got, _reference(small, targets, 500), small, 500)
