"""core: lossless speculative decoding, given a loaded target and its measured costs.

`engine` (prefill, then per pass: plan a draft, one target pass, the acceptance rule, commit;
yields events), `policy` (every draft-size decision, from acceptance and measured costs),
`proposers/` (n-gram lookup, draft model, EAGLE head), `tree` (drafts as chains or trees, verify
inputs), `verify` (greedy and lossless rejection sampling), `constraint` (a grammar's masks on
drafts and logits: structured output), `sampling` (logits to probabilities, seeded draws), `prompt`
(chat templating, the checks a prompt must pass), `stats` (one generation's counters and derived
figures). Imports base, kernels and runtime; never the store
(registry, files, downloads) or an app.
"""
