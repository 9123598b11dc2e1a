"""localspec_kernels: fast paths for the verify pass (installed under this name, from kernels/).

Every kernel added here comes with a plain torch reference beside it and a test comparing the two
(under TRITON_INTERPRET=1 on machines without a GPU). The 4-bit small-M matmul and the fused
rejection sampler are tracked in their own issue; until they land the engine uses torch only.
"""
