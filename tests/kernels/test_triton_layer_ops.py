"""kernels/triton/layer_ops.py against the layers' torch formulas: on a GPU when there is
one, else on CPU tensors under Triton's interpreter (set before triton is imported; see
tests/attention/test_triton_attention.py)."""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="the layer kernels need the `triton` package")

import torch.nn.functional as F  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagedllm.kernels.triton import layer_ops  # noqa: E402
from pagedllm.models.layers.rotary import RotaryEmbedding  # noqa: E402

if not ON_GPU and not isinstance(layer_ops._rms_norm_kernel, InterpretedFunction):
    pytest.skip("pagedllm.kernels.triton was imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

# float32: the same formula to rounding; 16-bit: the torch formulas round intermediates.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (w.float() + offset)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,offset", [(576, 0.0), (64, 1.0), (1000, 0.0)])
def test_rms_norm(dtype: torch.dtype, hidden: int, offset: float) -> None:
    torch.manual_seed(hidden)
    x = (torch.randn(5, hidden) * 3).to(DEVICE, dtype)
    w = torch.randn(hidden).to(DEVICE)
    out = layer_ops.rms_norm(x, w, 1e-6, offset)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref_rms_norm(x, w, 1e-6, offset).float(),
                               **TOL[dtype])


def test_rms_norm_per_head_of_strided_rows() -> None:
    """Qwen3's q_norm: [T, H, D] views of a fused qkv (row stride past H * D)."""
    qkv = torch.randn(3, 7 * 16).to(DEVICE)
    q = qkv[:, :4 * 16].reshape(3, 4, 16)
    w = torch.randn(16).to(DEVICE)
    out = layer_ops.rms_norm(q, w, 1e-5)
    assert out.shape == (3, 4, 16)
    torch.testing.assert_close(out, ref_rms_norm(q, w, 1e-5, 0.0), **TOL[torch.float32])


def test_rows_do_not_depend_on_the_batch() -> None:
    x = torch.randn(9, 300).to(DEVICE, torch.bfloat16)
    w = torch.randn(300).to(DEVICE)
    full = layer_ops.rms_norm(x, w, 1e-6)
    gated = layer_ops.silu_and_mul(x)
    for i in (0, 4, 8):
        assert torch.equal(layer_ops.rms_norm(x[i:i + 1], w, 1e-6), full[i:i + 1])
        assert torch.equal(layer_ops.silu_and_mul(x[i:i + 1]), gated[i:i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [96, 1536, 2100])  # 2100: three programs, the last partial
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    x = (torch.randn(4, 2 * d) * 2).to(DEVICE, dtype)
    gate, up = x.float().chunk(2, dim=-1)
    out = layer_ops.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (4, d)
    torch.testing.assert_close(out.float(), (F.silu(gate) * up).to(dtype).float(), **TOL[dtype])


def test_empty_batches() -> None:
    w = torch.ones(8).to(DEVICE)
    assert layer_ops.rms_norm(torch.empty(0, 8).to(DEVICE), w, 1e-6).shape == (0, 8)
    assert layer_ops.silu_and_mul(torch.empty(0, 8).to(DEVICE)).shape == (0, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (80, 32)])  # partial rotary
def test_rotary_embedding(dtype: torch.dtype, neox: bool, head_size: int,
                          rotary_dim: int) -> None:
    torch.manual_seed(head_size + rotary_dim)
    rope = RotaryEmbedding(head_size, rotary_dim, 64,
                           1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim),
                           is_neox_style=neox)
    cos, sin = rope.tables(DEVICE, dtype)
    heads, kv_heads, tokens = 4, 2, 5
    # q and k as the views of one fused qkv projection (strided rows).
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size).to(DEVICE, dtype)
    q, k, _ = qkv.split([heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    positions = torch.tensor([0, 7, 3, 63, 12], device=DEVICE)
    want_q = rope._apply(q.clone(), cos[positions], sin[positions])
    want_k = rope._apply(k.clone(), cos[positions], sin[positions])
    v_before = qkv[:, (heads + kv_heads) * head_size:].clone()
    layer_ops.rotary_embedding(q, k, positions, cos, sin, head_size, rotary_dim, neox)
    torch.testing.assert_close(q.float(), want_q.float(), **TOL[dtype])
    torch.testing.assert_close(k.float(), want_k.float(), **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size:], v_before)  # v untouched


def test_layers_take_the_kernels_where_layer_ops_for_gives_them(monkeypatch) -> None:
    """The layers' CUDA wiring, run here on CPU tensors: with `layer_ops_for` answering
    for every tensor (and the native CPU ops off), RMSNorm, SiluAndMul and
    RotaryEmbedding call the kernels and agree with their own torch formulas."""
    from pagedllm.models.layers import activation, norm, rotary

    calls = []

    def fake_layer_ops_for(x: torch.Tensor):
        calls.append(x.shape)
        return layer_ops

    torch.manual_seed(0)
    x = torch.randn(3, 48).to(DEVICE)
    rms = norm.RMSNorm(48, 1e-6, offset=1.0)
    rms.weight.data = torch.randn(48).to(DEVICE)
    rope = RotaryEmbedding(16, 16, 32, 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    qkv = torch.randn(3, 4 * 16).to(DEVICE)
    q, k = qkv[:, :32], qkv[:, 32:48]
    positions = torch.tensor([1, 5, 9], device=DEVICE)
    for module in (norm, activation, rotary):  # the torch formulas, also on a GPU
        monkeypatch.setattr(module, "cpu_ops_available", lambda t: False)
        monkeypatch.setattr(module, "layer_ops_for", lambda t: None)
    want = (rms(x), activation.SiluAndMul()(x), rope(positions, q.clone(), k.clone()))
    assert not calls
    for module in (norm, activation, rotary):
        monkeypatch.setattr(module, "layer_ops_for", fake_layer_ops_for)
    got = (rms(x), activation.SiluAndMul()(x), rope(positions, q, k))
    assert len(calls) == 3
    for g, w in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        torch.testing.assert_close(g, w, **TOL[torch.float32])
    assert got[2][0].data_ptr() == qkv.data_ptr()  # rotated in place, in the qkv rows
