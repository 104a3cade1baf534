"""LinearLoRA: a fused linear's shards each get their adapter's delta in their own
output rows (block-diagonal B), rows select adapters, and the torch path (CUDA, or a
CPU without the native kernels) agrees with the native op."""

from __future__ import annotations

import torch

from pagedllm.lora.layers import LinearLoRA, LoRABatch


def test_shards_rows_and_paths_agree():
    g = torch.Generator().manual_seed(0)
    k, sizes = 32, (24, 8, 8)  # a qkv-like fused linear
    n = sum(sizes)
    batch = LoRABatch()
    layer = LinearLoRA(batch, k, n, torch.device("cpu"))
    # Adapter 1 on shards 0 and 2 (rank 4 and 2), adapter 2 on shard 1 (rank 3).
    a0, b0 = torch.randn(4, k, generator=g), torch.randn(24, 4, generator=g)
    a2, b2 = torch.randn(2, k, generator=g), torch.randn(8, 2, generator=g)
    a1, b1 = torch.randn(3, k, generator=g), torch.randn(8, 3, generator=g)
    layer.add(1, [(0, a0, b0, 0.5), (32, a2, b2, 0.5)])
    layer.add(2, [(24, a1, b1, 2.0)])
    x = torch.randn(5, k, generator=g)
    base = torch.randn(5, n, generator=g)
    want = base.clone().double()
    xd = x.double()
    for i in (0, 3):  # adapter 1's rows
        want[i, :24] += 0.5 * (xd[i] @ a0.double().T) @ b0.double().T
        want[i, 32:] += 0.5 * (xd[i] @ a2.double().T) @ b2.double().T
    want[4, 24:32] += 2.0 * (xd[4] @ a1.double().T) @ b1.double().T
    batch.segments = ((1, torch.tensor([0, 3])), (2, torch.tensor([4])))
    results = []
    for native in (True, False):
        layer.native = native
        y = base.clone()
        layer.apply(x, y)
        results.append(y)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(y[[1, 2]], base[[1, 2]])  # rows of the base model untouched
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=2e-5)
    layer.remove(1)
    y = base.clone()
    layer.apply(x, y)
    assert torch.equal(y[:4], base[:4])
