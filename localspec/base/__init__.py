"""base: what every layer may use, and nothing else.

`errors` (the one user-facing error type, out-of-memory detection, an exception's first line),
`config` (frozen, validated settings for sampling, speculation and limits; where localspec's home
is), `files` (the rules for what localspec writes: checked names, atomic writes, locks, holds),
`reasons` (why a choice was made, in full and in a few words), `timings` (where a run's wall clock went).
No torch, and no import of any other layer.
"""
