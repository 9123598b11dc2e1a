"""kernels: the fast paths, each with a plain torch reference beside it and a test comparing the two.

CPU (compiled on first use with the system C++ compiler by `cpu_build`, loaded with ctypes):
`cpu_w4a8` (4-bit weights x int8 rows, AVX-512 VNNI / AVX2, AMX for whole sets of 16 rows, and the
bf16 prompt path on AMX tiles), `cpu_attention` (row-exact attention of a whole pass per layer),
`cpu_w8a8` / `cpu_int8` / `cpu_linear` (int8 weights on oneDNN, prepacked linears).
Portable: `int4_format` (group-wise int4 and its reference), `int4_linear`, `rejection_rule` (the
acceptance walk that `core.verify` and the fused sampler share).
GPU (Triton; checked on a CPU under TRITON_INTERPRET=1): `triton_int4` (small-M 4-bit matmul),
`triton_row_attention`, `triton_sampling` (fused rejection sampling, chain and tree), and
`triton_support` (whether Triton is here). No import of any other localspec layer but base.
"""
