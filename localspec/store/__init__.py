"""store: the models, files and measurements on this machine, and the session built from them.

`registry` (models.toml and the user's overlay), `hub` (pull / rm), `loading` (GGUF from the
mirror, converted and quantized caches, tokenizers, what stays on disk), `measurements` (pass
costs, dtype and draft-format choices, per-generation history: measured once, kept), `machine`
(whether a pair can run here), `proposer_catalog` (the proposers and the `auto` choice),
`session` (a name and options -> a calibrated engine). Imports every layer below; never an app.
"""
