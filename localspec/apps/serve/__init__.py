"""`localspec serve`: the OpenAI HTTP API over one engine, for editors, agents and web front-ends.

One generation at a time. The engine and its tokenizer are touched only on one worker thread,
which runs the answer ahead of the client and hands each pass's text to the event loop; the loop
stays free to stream, to queue the next requests (beyond the queue: 429) and to notice a client
that left. That client's generation then stops after the pass in flight, and closing the engine's
generator at a pass boundary leaves its cache holding exactly the committed tokens. The next request
reuses the longest cached prefix (the engine's prefill does that), which is what makes a chat
client's resent history cheap.

Every response carries `timings` (llama-server's field names, plus speculation's own), read from
the same `GenerationStats` that `/metrics` adds up, so the two always agree.

Rooms: `config` (the server's settings, the local-only default, the API key and CORS),
`requests` (request bodies checked into sampling settings, refusals as OpenAI error objects),
`turns` (the single stream: the engine thread, the slot and its queue, disconnects), `metrics`
(`timings` and the Prometheus counters), `tools` (tool definitions to the chat template, the
model's calls read back from its text), `logprobs` (the engine's log-probabilities in OpenAI's two
shapes), `api` (the endpoints and their SSE), `app` (the ASGI app, the socket, and the command that
serves until Ctrl-C).
"""
