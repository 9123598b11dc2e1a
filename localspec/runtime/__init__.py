"""runtime: the target's forward pass, made exact and fast on the machine it runs on.

`kv` (the cache: slots written in place, O(1) rollback, tree-path compaction, which tokens it
holds), `attention` (row-exact attention: each row of a verify pass computed as a one-token step
would), `decoder` (the short pass as one plain function over the model's own modules), `graphs`
(CUDA graphs of those passes), `quant` (weight formats of a loaded model and the CPU kernels'
layouts), `costs` (timing a pass per width and context, and the cost model read from it).
Imports base and kernels only; knows nothing of proposers, policies or files on disk beyond the
kernels' layouts.
"""
