"""The EAGLE proposer: features taken from the target's own passes, the dynamic tree it drafts,
exact greedy and sampled output through tree verification, and heads trained by train-eagle."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPT_IDS, hf_greedy, tiny_model
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.core.engine import Engine
from localspec.core.proposers.eagle import EagleProposer, FeatureTap
from localspec.core.proposers.eagle_head import EagleHead, HeadConfig, build_head, load_head, save_head
from localspec.core.sampling import make_generator
from localspec.core.tree import Draft, verify_inputs
from localspec.runtime.costs import CostModel
from test_lossless_sampling import PROMPT, VOCAB, chi2, chi2_limit, exact_pairs

CHEAP_WIDE_PASSES = CostModel({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3, 32: 1.8}, 0.0)


def random_head(target, version: int, draft_vocab: int | None = None, seed: int = 0) -> EagleHead:
    cfg = HeadConfig.for_target(target.config, version=version, draft_vocab_size=draft_vocab)
    torch.manual_seed(seed)
    lm_head = target.get_output_embeddings().weight if version == 1 else None
    head = EagleHead(cfg, target.get_input_embeddings().weight, lm_head)
    if version == 3 and cfg.draft_vocab_size < cfg.vocab_size:
        used = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
        head.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)  # peaked guesses, so trees have clear favourites
    return head.eval()


def generate(engine: Engine, prompt, n: int, **kw) -> list[int]:
    return [p.token_id for ev in engine.generate(prompt, limits=GenerationLimits(n), **kw) for p in ev.pieces]


@pytest.mark.parametrize("version", [1, 3])
def test_feature_tap_reads_the_hidden_states_the_head_is_defined_on(version):
    target = tiny_model("llama", layers=8, hidden=48)
    cfg = HeadConfig.for_target(target.config, version=version)
    tap = FeatureTap(target, cfg.aux_layers)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    got = tap.take()
    if version == 3:
        assert cfg.aux_layers == (2, 4, 5)  # inputs of layers 2, L//2, L-3
        expected = torch.cat([out.hidden_states[i][0] for i in cfg.aux_layers], dim=-1)
    else:
        expected = out.hidden_states[-1][0]  # after the final norm: what lm_head reads
    torch.testing.assert_close(got, expected)
    tap.remove()
    with torch.no_grad():
        target(ids)
    assert not tap.captured, "hooks are gone after remove()"


def test_the_tree_is_valid_ranked_and_a_chain_when_top_k_is_one():
    target = tiny_model("llama", layers=8, hidden=48)
    head = random_head(target, 3, draft_vocab=64)
    engine = Engine(target, None, None)
    for top_k, nodes in [(4, 12), (1, 4)]:
        proposer = EagleProposer(head, target, top_k=top_k, nodes=nodes, depth=4)
        engine.proposer = proposer
        engine.forget()
        engine._prefill(PROMPT_IDS)
        draft = proposer.propose(PROMPT_IDS, 64, SamplingConfig(), make_generator(0))
        assert len(draft) == nodes and draft.steps == 4
        assert all(-1 <= p < i for i, p in enumerate(draft.parents))
        for node in [-1, *range(len(draft))]:  # siblings: distinct tokens, the head's favourite first
            kids = draft.children(node)
            assert len({draft.tokens[k] for k in kids}) == len(kids)
            confidences = [draft.confidences[k] for k in kids]
            assert confidences == sorted(confidences, reverse=True)
        if top_k == 1:
            assert draft.is_chain
        # the verify pass sees each node at its depth, attending to its ancestors only
        ids, positions, mask = verify_inputs(draft, PROMPT_IDS[-1], len(PROMPT_IDS) - 1)
        assert positions[0, 1:].tolist() == [len(PROMPT_IDS) - 1 + d for d in draft.depths()]
        proposer.close()


@pytest.mark.parametrize("version", [1, 3])
def test_greedy_output_equals_plain_greedy(arch, version):
    target = tiny_model(arch, layers=8, hidden=48)
    head = random_head(target, version, draft_vocab=64 if version == 3 else None)
    expected = hf_greedy(target, PROMPT_IDS, 40)
    for settings in [dict(top_k=4, nodes=10, depth=3), dict(top_k=1, nodes=4, depth=4), dict()]:
        proposer = EagleProposer(head, target, **settings)
        engine = Engine(target, None, proposer, SpecConfig(), costs=CHEAP_WIDE_PASSES)
        assert generate(engine, PROMPT_IDS, 40) == expected, settings
        # a second turn reuses both caches (target and head) and stays exact
        follow = PROMPT_IDS + expected + [30, 31]
        assert generate(engine, follow, 12) == hf_greedy(target, follow, 12)
        proposer.close()


def test_an_always_right_head_is_accepted_through_the_tree():
    """A head copying the target's greedy choice (EAGLE-1 whose layer is switched off reads the
    target's own last hidden state) must get whole paths accepted."""
    target = tiny_model("llama", layers=8, hidden=48)
    head = random_head(target, 1)
    with torch.no_grad():
        for p in head.midlayer.parameters():
            p.zero_()
        h = head.cfg.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)  # out = feature: logits = the target's at that position
    proposer = EagleProposer(head, target, top_k=2, nodes=6, depth=3)
    engine = Engine(target, None, proposer, SpecConfig())
    expected = hf_greedy(target, PROMPT_IDS, 30)
    assert generate(engine, PROMPT_IDS, 30) == expected
    # the head only knows the first guess (its own features stop at the committed tokens)
    assert engine.stats.accepted >= engine.stats.passes - 1


def test_sampling_through_eagle_trees_keeps_the_target_distribution():
    target = tiny_model("llama", seed=3, vocab=VOCAB, layers=8, hidden=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.3)  # a soft target, so rejections are common
    head = random_head(target, 3, seed=5)
    proposer = EagleProposer(head, target, top_k=3, nodes=6, depth=2)
    engine = Engine(target, None, proposer, SpecConfig())
    sampling_kw = dict(temperature=1.0)
    n = 600
    counts: dict = {}
    accepted = 0
    for seed in range(n):
        out = generate(engine, PROMPT, 2, sampling=SamplingConfig(seed=seed, **sampling_kw))
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        accepted += engine.stats.accepted
    assert accepted > n / 10, "the test must exercise acceptance through the tree"
    assert not engine.stats.notices
    stat, df = chi2(counts, exact_pairs(target, SamplingConfig(**sampling_kw)), n)
    assert stat < chi2_limit(df), (stat, df)


@pytest.mark.parametrize("version", [1, 3])
def test_saved_head_reloads_bit_identically(tmp_path, version):
    target = tiny_model("llama", layers=8, hidden=48)
    head = random_head(target, version, draft_vocab=64 if version == 3 else None)
    save_head(head, tmp_path)
    again = build_head(load_head(tmp_path, target.config), target)
    assert again.cfg == head.cfg
    for (name, a), (_, b) in zip(sorted(head.state_dict().items()), sorted(again.state_dict().items())):
        assert torch.equal(a, b), name


# -- a head trained for the real SmolLM2-135M ---------------------------------------------------

HELD_OUT = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain what a Python generator is, with a short example.",
    "Write a function that counts how often each word appears in a text.",
    "How do I read a CSV file in Python and print the first column?",
]


@pytest.mark.real_model
def test_a_head_trained_here_for_smollm2_drafts_two_tokens_per_pass(tmp_path):
    from localspec.apps.train_eagle import TrainSettings, train_eagle
    from localspec.store.loading import load_model
    from localspec.store.registry import load_registry

    loaded = load_model(load_registry().get("smollm2-135m"), torch.float32, progress=False)
    # the test-sized budget: 128 greedy answers of up to 160 tokens, 6 epochs (about 7 min on 2 AVX2 cores)
    settings = TrainSettings(max_tokens=0, self_distill=128, epochs=6)
    summary = train_eagle(loaded, tmp_path, None, settings, quiet=True)
    assert summary["steps"] > 0
    head = build_head(load_head(tmp_path, loaded.model.config), loaded.model)
    proposer = EagleProposer(head, loaded.model, top_k=8, nodes=48, depth=6)
    engine = Engine(loaded.model, loaded.tokenizer, proposer, SpecConfig())
    plain = Engine(loaded.model, loaded.tokenizer, None)
    passes = tokens = 0
    for prompt in HELD_OUT:
        out = generate(engine, prompt, 64)
        assert out == generate(plain, prompt, 64), prompt  # exact: the target's own greedy answer
        passes += engine.stats.passes
        tokens += engine.stats.new_tokens
    assert tokens / passes >= 2.0, (tokens / passes, summary)
    proposer.close()
