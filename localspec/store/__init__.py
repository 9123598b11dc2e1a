"""store: the models, files and measurements on this machine, and the session built from them.

`registry` (models.toml and the user's overlay), `hub` (pull / rm), `paths` (where a model's files
live, what is here), `gguf_mirror` (the GGUF from PyPI), `converted` and `quantized` (the copies
made from it), `tokenizers`, `loading` (a model read and placed), `cleanup` (what stays on disk),
`progress` (what a load shows), `measurements` (pass costs, dtype and draft-format choices:
measured once, kept), `history` (what each generation measured), `machine` (whether a pair can run here),
`proposer_catalog` (the proposers and the `auto` choice), `session` (a name and options -> a
calibrated engine). Imports every layer below; never an app.
"""
