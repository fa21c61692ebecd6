"""Fused Triton kernels for the layers (the GPU path; on the CPU only under ``TRITON_INTERPRET=1``).

One module per op, each with its kernel, the launcher the layers call, and the torch reference
the tests compare it with:

- ``norm``: RMSNorm with the residual add fused in (the residual updated in place)
- ``rotary``: GPT-NeoX rotate-half rotary embedding, in place, from the cos/sin cache
- ``activation``: SiLU-and-mul of a fused gate/up projection
- ``sampling``: per-row top-k / top-p / min-p filtering of the sampler's logits
- ``int8_gemm``: weight-only int8 GEMM, weights widened and scaled in registers
- ``grouped_gemm``: weight-only 4/8-bit group-wise GEMM (GPTQ/AWQ/compressed-tensors/int4 layout),
  nibbles unpacked and group scales applied in registers
- ``fused_moe``: the experts of an MoE layer, slots sorted by expert on the device and one grouped
  GEMM pair over all experts (no host sync: CUDA-graph capturable)

Nothing here is imported unless a model is built for the Triton ops (``layers/ops.py``):
Triton decides at decoration time whether a kernel is interpreted, and importing it is not
free on a machine without a GPU.
"""
