"""apps: what a person runs. Each opens a session through the store and reads the engine's events.

`cli` (run / bench / models / chat / pull / rm / pair / serve / train-eagle), `serve/` (the
OpenAI-compatible API), `tui/` (the Textual chat), `bench` (the side-by-side benchmark),
`llamacpp` (a user's llama.cpp build run on the same files, for `bench`), `pairing` (the wizard
that measures every proposer), `train_eagle` (an EAGLE head trained here). Nothing below imports
an app.
"""
