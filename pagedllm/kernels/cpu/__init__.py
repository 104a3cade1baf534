"""Native CPU kernels: paged attention, the packed bf16 GEMM, the GEMM on GGUF blocks
(`quant.py` holds their layout), fused element-wise ops, row argmax and the Llama decoder
stack (csrc/).

`build.py` compiles and loads them (or fails loudly, per PAGEDLLM_CPU_KERNELS),
`features.py` is the one place that reads the CPU's feature flags, and `ops.py` holds one
typed Python wrapper per op: the rest of the package calls those, never `torch.ops`.
"""
