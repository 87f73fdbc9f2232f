"""The sampler head (sdsat/head.py): drafts conditioned on the token before them, losslessly.

On a tiny model with a tiny vocabulary: greedy output equals vanilla; the standard-token logits do not
move; sampled output has vanilla sampling's exact distribution at every position (chi-square), and a head
that misreports q fails the same test; the head's training loss falls and a resumed run equals an
uninterrupted one; saving and loading round-trip. On the real model: the shipped drafter loads and its
greedy output equals vanilla's.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import sdsat.drafters as drafters
from conftest import make_tiny_llama
from sdsat.decoding import DecodeConfig, collect, decode
from sdsat.drafters import DraftContext, conditioned_draft_pass
from sdsat.head import HeadConfig, SamplerHead, head_beside, head_drafts, match_lengths, native_scores
from sdsat.sampling import SamplingConfig, TokenChooser
from sdsat.sat import AdapterConfig, SatAdapter, SatModel, SatSpec
from sdsat.timing import Clock
from sdsat.train.head import HeadTrainConfig, extract, load_features, train
from test_sampling import ALPHA, PROMPT, SAMPLES, SilentTokenizer, exact_marginals, marginal_fit

VOCAB = 8
POSITIONS = 4
# "5 3 t" followed by t + 1 for every t, then "5 3": whatever t is drawn, draft 1 has a run of three to follow
REPEATING_PROMPT = [token for t in range(VOCAB) for token in (5, 3, t, (t + 1) % VOCAB)] + [5, 3]


def tiny_sat_model(head: bool, candidates: int = 5, seed: int = 0, combiner: int = 0) -> SatModel:
    """The sampling tests' tiny model and adapter, with a random head (K of the 8 tokens) when `head`, and a random
    combiner of its terms of that many units."""
    model = make_tiny_llama(vocab_size=VOCAB, layers=1, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    config = AdapterConfig(base_model="tiny", hidden_size=model.config.hidden_size, num_layers=1, num_sats=4, rank=4)
    adapter = SatAdapter.for_model(model, config, init_token_id=3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        adapter.embeddings.add_(torch.randn(adapter.embeddings.shape, generator=gen) * 0.02)
        for b in adapter.lora_b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
    sat_model = SatModel(model, SatSpec(kind="adapter", max_k=4), adapter)
    if head:
        torch.manual_seed(seed)
        sat_model.sampler = SamplerHead(HeadConfig(base_model="tiny", hidden_size=model.config.hidden_size,
                                                   num_sats=4, width=16, candidates=candidates,
                                                   combiner=combiner))
        with torch.no_grad():  # a head that really moves q, by the token before each draft
            sat_model.sampler.out.weight.normal_(0, 0.5)
            if combiner:
                sat_model.sampler.combine_out.weight.normal_(0, 1.0)
            sat_model.sampler.pair_weight.fill_(0.5)
            sat_model.sampler.context_weight.fill_(1.0)
            sat_model.sampler.context3_weight.fill_(0.7)
            sat_model.sampler.match_weight.copy_(torch.tensor([0.9, 1.4, 0.3, 2.0]))  # per SAT position
        sat_model.sampler.config.context = sat_model.sampler.config.context3 = True  # the text's own pairs and triples
        sat_model.sampler.config.match = True  # and its longest matches
        pairs = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(seed))
        sat_model.sampler.config.vocab_size = VOCAB
        sat_model.sampler.set_bigrams({"bigram_keys": (pairs[:-1] * VOCAB + pairs[1:]).unique(),
                                       "bigram_counts": torch.bincount(pairs[:-1] * VOCAB + pairs[1:])[
                                           (pairs[:-1] * VOCAB + pairs[1:]).unique()].float(),
                                       "prev_counts": torch.bincount(pairs[:-1], minlength=VOCAB).float()})
    return sat_model


def sampled_positions(sat_model: SatModel, k: int, settings: dict, seeds: range, extra: int = 0,
                      scheme: str = "two_step", prompt: list[int] = PROMPT) -> list[Counter]:
    counts = [Counter() for _ in range(POSITIONS)]
    for seed in seeds:
        config = DecodeConfig(method="sdsat", k=k, max_new_tokens=POSITIONS + 1, tree_candidates=extra, scheme=scheme,
                              sampling=SamplingConfig(do_sample=True, seed=seed, **settings))
        result = collect(decode(sat_model, SilentTokenizer(), prompt, config, eos_ids=[]))
        for i, token in enumerate(result.token_ids[:POSITIONS]):
            counts[i][token] += 1
    return counts


def p_values(sat_model: SatModel, k: int, settings: dict, extra: int = 0, scheme: str = "two_step",
             prompt: list[int] = PROMPT) -> list[float]:
    marginals = exact_marginals(sat_model.model, settings, POSITIONS, prompt)
    counts = sampled_positions(sat_model, k, settings, range(SAMPLES), extra, scheme, prompt)
    return [marginal_fit(c, m) for c, m in zip(counts, marginals)]


def test_greedy_with_the_head_equals_vanilla():
    sat_model = tiny_sat_model(head=True)
    vanilla = collect(decode(sat_model, SilentTokenizer(), PROMPT, DecodeConfig(method="vanilla", max_new_tokens=24),
                             eos_ids=[]))
    for k, extra, scheme in ((1, 0, "two_step"), (3, 0, "two_step"), (3, 4, "two_step"), (2, 0, "fused")):
        config = DecodeConfig(method="sdsat", k=k, max_new_tokens=24, tree_candidates=extra, scheme=scheme)
        result = collect(decode(sat_model, SilentTokenizer(), PROMPT, config, eos_ids=[]))
        assert result.token_ids == vanilla.token_ids
        # the fused scheme's later drafts, from its verify passes, go through the head too
        assert all(step.conditioned for step in result.steps if step.draft_pass or scheme == "fused")


def test_the_cost_curve_times_draft_and_fused_passes_with_the_heads_drafts():
    """On a model with a sampler head the curve times draft and fused passes as decoding runs them, the head's
    drafts included, for each k."""
    from sdsat.costs import measure_curve

    curve = measure_curve(tiny_sat_model(head=True), widths=(1, 2), drafts=2, context=8, repeats=1, trees=False)
    assert set(curve.draft) == set(curve.fused) == {1, 2}
    assert all(s > 0 for s in [*curve.draft.values(), *curve.fused.values()])


def test_the_fused_schemes_later_drafts_are_the_heads_given_the_bonus_token():
    """After a fused verify pass, the next drafts are the head's over the SAT run anchored at the last accepted
    token, draft 1 conditioned on that pass's bonus token: greedy, each is the top of the head's own logits for its
    row given the token before it."""
    sat_model = tiny_sat_model(head=True)
    model, head = sat_model.model, sat_model.sampler
    embed_in, embed_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    config = DecodeConfig(method="sdsat", k=2, max_new_tokens=16, scheme="fused")
    result = collect(decode(sat_model, SilentTokenizer(), PROMPT, config, eos_ids=[]))
    checked = 0
    for before, step in zip(result.steps, result.steps[1:]):
        history = PROMPT + [t for s in result.steps[:step.index] for t in s.tokens]  # ends with the bonus
        bonus = history[-1]
        assert bonus == before.tokens[-1] and not step.draft_pass
        # the run the verify pass anchored at the last accepted token (history[:-1] ends with it), computed alone as
        # a draft pass after that token computes it: its SAT 1 stands where the bonus does and drafts the token after
        ids = torch.tensor([history[:-1] + [0, 0]])
        slots = torch.tensor([[-1] * (len(history) - 1) + [0, 1]])
        with torch.inference_mode():
            hidden = sat_model.hidden_states(ids, slots)[0, -2:]
            prev, text = [bonus] + step.drafts[:-1], torch.tensor(history + step.drafts)
            for j in range(2):
                row = head.logits(hidden[j:j + 1], sat_model.head(hidden[j:j + 1]), torch.tensor([prev[j]]),
                                  torch.tensor([j]), embed_in, embed_out, text, torch.tensor([len(history) - 1 + j]))
                assert step.drafts[j] == int(row[0].argmax())
        checked += 1
    assert checked >= 3


def test_standard_token_logits_are_bit_equal_with_and_without_adapter_and_head():
    """The draft pass's t logits through the head's path (hidden states, then the LM head) equal the plain
    pass's, and the verify pass is the base model's own."""
    plain, headed = tiny_sat_model(head=False), tiny_sat_model(head=True)
    ids = torch.tensor([PROMPT + [0, 0, 0]])
    slots = torch.tensor([[-1] * len(PROMPT) + [0, 1, 2]])
    through_head = headed.head(headed.hidden_states(ids, slots)[0, -4:])
    assert torch.equal(plain.forward(ids, slots, logits_to_keep=4)[0], through_head)
    block = torch.tensor([PROMPT + [4, 1]])
    assert torch.equal(headed.forward(block), plain.model(input_ids=block).logits)
    # the first row (t) of a draft pass equals a pass over the standard tokens alone
    alone = plain.model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
    assert torch.allclose(through_head[0], alone, atol=1e-5)


@pytest.mark.parametrize("settings", [dict(do_sample=True, temperature=1.3, seed=3),
                                      dict(do_sample=True, temperature=0.8, top_k=2, seed=4),
                                      dict(do_sample=True, top_p=0.9, seed=5), dict()])
def test_q_is_the_distribution_each_draft_was_drawn_from(settings):
    """Each row of q is conditioned on the draft before it: feeding the head those drafts again gives q, warped
    over the whole vocabulary as vanilla sampling warps (the head warps and draws among its candidates alone);
    greedy drafts are that row's top token."""
    sat_model = tiny_sat_model(head=True)
    from transformers import DynamicCache

    chooser = TokenChooser(SamplingConfig(**settings), sat_model.device)
    ctx = DraftContext(sat_model, chooser, DynamicCache(config=sat_model.model.config), list(PROMPT), list(PROMPT),
                       8, Clock(sat_model.device))
    with torch.inference_mode():
        t, _, q, drafts, _ = conditioned_draft_pass(ctx, 3)
    assert q.shape == (3, VOCAB) and drafts.shape == (3,)
    assert ((q > 0).sum(-1) <= sat_model.sampler.config.candidates).all()
    prev = [t] + drafts.tolist()[:-1]
    model = sat_model.model
    hidden = sat_model.hidden_states(torch.tensor([PROMPT + [0] * 3]), torch.tensor([[-1] * 3 + [0, 1, 2]]))[0, -3:]
    text = torch.tensor(PROMPT + [t] + drafts.tolist())
    for j in range(3):  # the same rows again, outside the cache: equal up to rounding
        end = len(PROMPT) + j  # where draft j + 1's prev stands
        row = sat_model.sampler.logits(hidden[j:j + 1], sat_model.head(hidden[j:j + 1]), torch.tensor([prev[j]]),
                                       torch.tensor([j]), model.get_input_embeddings().weight,
                                       model.get_output_embeddings().weight, text, torch.tensor([end]))
        assert torch.allclose(chooser.probs(row)[0], q[j], atol=1e-6)
        if settings.get("top_k"):
            assert int((q[j] > 0).sum()) <= settings["top_k"]
        if not settings:
            assert int(drafts[j]) == int(row[0].argmax())


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("mlp,context,k,combiner", [(False, True, 3, 0), (True, False, 3, 0), (False, False, 1, 0),
                                                    (True, True, 1, 0), (True, True, 3, 8), (False, False, 3, 8),
                                                    (True, "pairs", 3, 8), (True, False, 3, 8)])
def test_drafting_a_pass_at_once_equals_each_row_scored_alone(mlp, context, k, combiner, compiled, monkeypatch,
                                                              request):
    """head_drafts scores a pass's rows with what they share computed once (SamplerHead.drafting, TextCounts): with
    or without the MLP, the text's counts (pairs and triples, pairs alone, or none) and the combiner, k of 1 or 3,
    each row's q equals the head's own logits for that row, given the drafts before it, warped (sampled at T 1.3, so
    every candidate keeps mass). `compiled`: each draft's scores from the compiled kernel (csrc/head_score.cpp),
    which serves a head with an MLP; otherwise PyTorch's ops."""
    if compiled and not mlp:
        pytest.skip("the compiled scores serve heads with an MLP")
    calls = compiled_calls(monkeypatch, request, compiled)
    sat_model = tiny_sat_model(head=True, combiner=combiner)
    head = sat_model.sampler
    head.config.context, head.config.context3 = bool(context), context is True
    if not mlp:
        head.config.width = 0
    chooser = TokenChooser(SamplingConfig(do_sample=True, temperature=1.3, seed=2), sat_model.device)
    model = sat_model.model
    embed_in, embed_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    # after it, t = 2: pairs and triples seen before, and "6 2 d" followed by d + 1 for every d, so that whatever
    # draft 1 is, draft 2 has a run of three to follow
    history = PROMPT + [token for d in range(VOCAB) for token in (6, 2, d, (d + 1) % VOCAB)] + [5, 6]
    with torch.inference_mode():
        ids = torch.tensor([history + [0] * k])
        slots = torch.tensor([[-1] * len(history) + list(range(k))])
        hidden = sat_model.hidden_states(ids, slots)[0, -k:]
        logits = sat_model.head(hidden)
        t = 2
        q, drafts = head_drafts(head, hidden, logits, t, embed_in, embed_out, chooser.probs, chooser.draw, history)
        text = torch.tensor(history + [t] + drafts.tolist())
        prev = [t] + drafts.tolist()[:-1]
        for j in range(k):
            end = len(history) + j
            row = head.logits(hidden[j:j + 1], logits[j:j + 1], torch.tensor([prev[j]]), torch.tensor([j]), embed_in,
                              embed_out, text, torch.tensor([end]))
            assert torch.allclose(chooser.probs(row)[0], q[j], atol=1e-6)
            assert q[j, drafts[j]] > 0
        ends = torch.arange(len(history), len(history) + k)
        candidates = logits.topk(head.config.candidates, dim=-1).indices
        read = match_lengths(text, ends, candidates)  # what each row's match term read
        # a later draft's term read a run of three or more (where a slot's weight would show a mix-up)
        assert k == 1 or (read[1:].amax(-1) >= 3).any()
    assert calls == ([None] * k if compiled else [])  # one compiled call per draft, or none


def compiled_calls(monkeypatch, request, compiled: bool) -> list:
    """Turn the head's compiled scores on (building the kernels, or skipping where they cannot be built) or off; the
    list returned grows by one item per compiled call."""
    from sdsat import head as head_module

    if compiled:
        request.getfixturevalue("native_kernels")
    monkeypatch.setenv("SDSAT_HEAD_KERNEL", "1" if compiled else "0")
    kernels, calls = native_scores(), []  # the real lookup (a test may have patched the module's before)
    assert (kernels is not None) == compiled

    class Counted:
        def head_score(self, *args):
            calls.append(None)
            return kernels.head_score(*args)

    monkeypatch.setattr(head_module, "native_scores", lambda: Counted() if kernels is not None else None)
    return calls


def test_the_compiled_scores_read_a_bfloat16_embedding_as_the_ops_do(monkeypatch, request):
    """A bfloat16 model's input embeddings (the shipped model decodes in bfloat16): the compiled scores widen the
    token's row as PyTorch's ops do, so each draft's q is the same either way."""
    sat_model = tiny_sat_model(head=True, combiner=8)
    model, head = sat_model.model, sat_model.sampler
    embed_in = model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    embed_out = model.get_output_embeddings().weight.detach().to(torch.bfloat16)
    chooser = TokenChooser(SamplingConfig(do_sample=True, temperature=1.3, seed=2), sat_model.device)
    history = PROMPT + [6, 2, 3, 6, 2, 1, 6]
    with torch.inference_mode():
        ids = torch.tensor([history + [0] * 3])
        hidden = sat_model.hidden_states(ids, torch.tensor([[-1] * len(history) + [0, 1, 2]]))[0, -3:]
        logits = sat_model.head(hidden)
        qs = {}
        for compiled in (False, True):
            calls = compiled_calls(monkeypatch, request, compiled)
            chooser.generator.manual_seed(5)
            qs[compiled] = head_drafts(head, hidden, logits, 2, embed_in, embed_out, chooser.probs, chooser.draw,
                                       history)
            assert len(calls) == (3 if compiled else 0)
    assert torch.equal(qs[False][1], qs[True][1]) and torch.allclose(qs[False][0], qs[True][0], atol=1e-6)


@pytest.mark.parametrize("name,k,extra,settings,combiner", [
    ("chain-t1.3-k3", 3, 0, dict(temperature=1.3), 0),
    ("chain-t0.7-topp0.9-k2", 2, 0, dict(temperature=0.7, top_p=0.9), 0),
    ("tree-t1-k2", 2, 3, dict(temperature=1.0), 0),
    ("chain-t1.3-k3-combiner", 3, 0, dict(temperature=1.3), 8),
    ("chain-t1.3-k3-combiner-compiled", 3, 0, dict(temperature=1.3), 8),
    ("fused-t1.3-k2", 2, 0, dict(temperature=1.3), 0),
    ("chain-t1.3-k3-repeats", 3, 0, dict(temperature=1.3), 8),
])
def test_sampling_with_the_head_gives_vanilla_sampling_at_every_position(name, k, extra, settings, combiner,
                                                                          monkeypatch, request):
    """Each draft's scores from the compiled kernel where the name says so, else from PyTorch's ops. "repeats": a
    prompt that repeats itself, so that the match term reads runs of three or more at many drafts."""
    calls = compiled_calls(monkeypatch, request, name.endswith("compiled"))
    scheme = "fused" if name.startswith("fused") else "two_step"
    prompt = REPEATING_PROMPT if name.endswith("repeats") else PROMPT
    p = p_values(tiny_sat_model(head=True, combiner=combiner), k, settings, extra, scheme, prompt)
    assert min(p) > ALPHA, p
    assert bool(calls) == name.endswith("compiled")


@pytest.mark.parametrize("scheme", ["two_step", "fused"])
def test_a_head_that_misreports_q_fails_the_same_test(monkeypatch, scheme):
    """Drafts drawn from the head but tested against the SATs' own q (the q a blind drafter would report)
    shift the output beyond the test's tolerance: the test has power over the head's q. In the fused scheme only
    the drafts after a verify pass misreport (the first draft pass's history is the prompt alone), at k = 1, so
    that those later drafts decide most positions."""
    honest = head_drafts

    def misreported(head, hidden, logits, t, embed_in, embed_out, warp, draw, history=()):
        q, drafts = honest(head, hidden, logits, t, embed_in, embed_out, warp, draw, history)
        later = len(history) > len(PROMPT)
        return (warp(logits) if scheme == "two_step" or later else q), drafts

    monkeypatch.setattr(drafters, "head_drafts", misreported)
    p = p_values(tiny_sat_model(head=True), 3 if scheme == "two_step" else 1, dict(temperature=1.3), scheme=scheme)
    assert min(p) < ALPHA, p


def test_the_bigram_term_reads_the_table_and_round_trips(tmp_path):
    from sdsat.train.head import count_bigrams

    class Tokens:
        def encode(self, text):
            return [int(x) for x in text.split()]

    table = count_bigrams(Tokens(), ["1 2 1 2 1 3", "5 6"], vocab=VOCAB, progress=False)
    head = SamplerHead(HeadConfig(base_model="tiny", hidden_size=32, num_sats=4, width=0, candidates=3,
                                  vocab_size=VOCAB))
    head.set_bigrams(table)
    logp = head.pair_logp(torch.tensor([1, 4]), torch.tensor([[2, 3, 7], [2, 3, 7]]))
    # after 1: 2 twice, 3 once, 7 never (smoothed by 0.1 each over the 3 candidates); after 4 nothing: uniform
    expected = torch.log(torch.tensor([[2.1, 1.1, 0.1], [0.1, 0.1, 0.1]]) / torch.tensor([[3.3], [0.3]]))
    assert torch.allclose(logp, expected)
    head.save(tmp_path)
    loaded = SamplerHead.load(tmp_path)
    assert torch.equal(loaded.bigram_keys, head.bigram_keys) and loaded.bigram_keys.dtype == torch.long
    assert torch.equal(loaded.pair_logp(torch.tensor([1, 4]), torch.tensor([[2, 3, 7], [2, 3, 7]])), logp)


def test_seen_after_counts_the_pairs_before_each_position():
    from sdsat.head import seen_after

    text = torch.tensor([5, 1, 2, 5, 1, 3, 5, 1])
    # at position 7 (token 1): 1 was followed by 2 once and by 3 once before; at position 4 (token 1): by 2 once
    counts = seen_after(text, torch.tensor([7, 4, 0]), torch.tensor([[2, 3, 5], [2, 3, 5], [1, 5, 2]]))
    assert counts.tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0]]


def test_seen_after_of_order_3_counts_the_triples_before_each_position():
    from sdsat.head import seen_after

    text = torch.tensor([5, 1, 2, 4, 1, 3, 5, 1, 2, 5, 1])
    # at position 10 (5, 1): (5, 1) was followed by 2 twice before, never by 3 (that 1 came after a 4); at
    # position 7 (5, 1): by 2 once; at position 1 nothing came before; order 2 counts every 1 alike
    ends, cand = torch.tensor([10, 7, 1]), torch.tensor([[2, 3, 5], [2, 3, 5], [2, 3, 5]])
    assert seen_after(text, ends, cand, order=3).tolist() == [[2, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert seen_after(text, ends, cand).tolist() == [[2, 1, 0], [1, 1, 0], [0, 0, 0]]
    # the text's first pair counts (1, 2 at positions 0, 1, followed by 1, before 1, 2 at 2, 3); 7 comes after
    edge = seen_after(torch.tensor([1, 2, 1, 2, 7]), torch.tensor([3]), torch.tensor([[1, 7]]), order=3)
    assert edge.tolist() == [[1, 0]]


def test_text_counts_equal_seen_after_as_the_text_grows():
    """A draft pass counts the text's pairs and triples once (TextCounts) and adds each draft as it is drawn: at
    every length its counts at the last token equal `seen_after`'s over the whole text, and its longest matches
    `match_lengths`' (from three tokens, the ones the match term reads)."""
    from sdsat.head import TextCounts, seen_after

    gen = torch.Generator().manual_seed(2)
    text = torch.randint(0, 9, (60,), generator=gen).tolist()  # tokens beyond the candidates too
    text[36:58] = text[5:27]  # a run longer than the cap to find
    cand = torch.tensor([[0, 1, 2], [2, 3, 4]])
    counts = TextCounts(text[:40], cand, matches=True)
    for end in range(39, 60):
        if end > 39:
            counts.append(text[end])
        for row in cand.tolist():
            whole, where = torch.tensor(text[:end + 1]), torch.tensor([end])
            pairs, triples = counts.after_last(row)
            assert pairs == seen_after(whole, where, torch.tensor([row]))[0].tolist()
            assert triples == seen_after(whole, where, torch.tensor([row]), order=3)[0].tolist()
            longest = match_lengths(whole, where, torch.tensor([row]))[0].tolist()
            assert counts.longest_matches(row) == [n if n >= 3 else 0 for n in longest]  # the term reads 3 and up


def test_match_lengths_equal_a_plain_search():
    """For each row and candidate c: the longest run of tokens ending at the row's position that also ended earlier
    at some i with c at i + 1 (i + 1 <= the position), capped; checked against a search written out plainly."""
    gen = torch.Generator().manual_seed(4)
    text = torch.randint(0, 4, (70,), generator=gen)  # four tokens: long matches are common
    text[40:62] = text[5:27]  # a run of 22 copied
    ends = torch.tensor([0, 1, 5, 21, 40, 61, 69])
    cand = torch.arange(4)[None].expand(len(ends), 4)
    seq = text.tolist()

    def plain(end: int, c: int, cap: int) -> int:
        best = 0
        for i in range(end):
            if seq[i + 1] != c:
                continue
            n = 0
            while n < cap and i - n >= 0 and seq[i - n] == seq[end - n]:
                n += 1
            best = max(best, n)
        return best

    for cap in (16, 5):
        found = match_lengths(text, ends, cand, cap=cap, rows=3)  # rows in two chunks and a remainder
        assert found.tolist() == [[plain(int(e), c, cap) for c in range(4)] for e in ends]
    assert match_lengths(text, ends, cand)[5].max() == 16  # the copied run is longer than the cap


def test_the_match_term_follows_the_longest_match():
    """Scores with the match term are the scores without it plus m_j log(1 + max(0, L - 2)), after the combiner; in
    drafting, a head with a large m_j drafts what followed the longest earlier match of the text's end."""
    sat_model = tiny_sat_model(head=True, candidates=VOCAB, combiner=8)
    head = sat_model.sampler
    gen = torch.Generator().manual_seed(7)
    n, k, hidden = 3, 5, head.config.hidden_size
    h, embed = torch.randn(n, hidden, generator=gen), torch.randn(VOCAB, hidden, generator=gen)
    prev, slot, cand = torch.tensor([1, 4, 6]), torch.tensor([0, 1, 3]), torch.randint(0, VOCAB, (n, k), generator=gen)
    z, seen, seen3 = torch.randn(n, k, generator=gen), torch.randint(0, 4, (n, k)), torch.randint(0, 3, (n, k))
    lengths = torch.tensor([[0, 2, 3, 7, 16], [1, 0, 0, 0, 4], [3, 3, 0, 0, 0]])
    with torch.no_grad():
        head.match_weight.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0]))
        scores, _ = head.scores(h, prev, slot, cand, z, embed, embed, seen, seen3, lengths)
        head.config.match = False
        alone, _ = head.scores(h, prev, slot, cand, z, embed, embed, seen, seen3)
        head.config.match = True
        with pytest.raises(ValueError, match="longest matches"):
            head.scores(h, prev, slot, cand, z, embed, embed, seen, seen3)
    term = head.match_weight.detach()[slot][:, None] * torch.log1p((lengths.float() - 2).clamp(min=0))
    assert torch.allclose(scores, alone + term, atol=1e-6)
    assert term[1, :4].eq(0).all() and term[0, 3] > term[0, 2] > 0

    model = sat_model.model
    embed_in, embed_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    history = PROMPT + [5, 7, 1, 4, 0, 6, 2, 3, 5, 7, 1, 4, 0]  # t = 6 makes "5 7 1 4 0 6" again: 2 followed it
    chooser = TokenChooser(SamplingConfig(), sat_model.device)
    with torch.inference_mode():
        ids = torch.tensor([history + [0] * 3])
        hidden_states = sat_model.hidden_states(ids, torch.tensor([[-1] * len(history) + [0, 1, 2]]))[0, -3:]
        logits = sat_model.head(hidden_states)
        head.match_weight.fill_(50.0)
        _, drafts = head_drafts(head, hidden_states, logits, 6, embed_in, embed_out, chooser.probs, chooser.draw,
                                history)
        head.config.match = False
        _, without = head_drafts(head, hidden_states, logits, 6, embed_in, embed_out, chooser.probs, chooser.draw,
                                 history)
    assert drafts.tolist() == [2, 3, 5]  # the rest of the earlier run, draft after draft
    assert without.tolist() != [2, 3, 5]


def test_a_head_saved_before_the_context_and_match_terms_loads_with_them_off(tmp_path):
    from safetensors.torch import load_file, save_file

    head = tiny_sat_model(head=True).sampler
    head.config.context = head.config.context3 = False
    head.save(tmp_path)
    tensors = load_file(str(tmp_path / "sampler_head.safetensors"))
    del tensors["context_weight"], tensors["context3_weight"], tensors["match_weight"]
    save_file(tensors, str(tmp_path / "sampler_head.safetensors"))
    config = json.loads((tmp_path / "sampler_head.json").read_text())
    del config["match"]
    (tmp_path / "sampler_head.json").write_text(json.dumps(config))
    loaded = head_beside(tmp_path)
    assert not loaded.config.context3 and torch.equal(loaded.context3_weight, torch.zeros(4))
    assert not loaded.config.match and torch.equal(loaded.match_weight, torch.zeros(4))
    assert torch.equal(loaded.pair_weight, head.pair_weight)


def test_the_combiner_adds_its_mlp_of_each_candidates_terms():
    """g = combine_out(gelu(combine_in(terms) + position)) over [z - max z, pair, log1p counts, mlp, score - max], added
    to the score the terms give alone."""
    head = tiny_sat_model(head=True, combiner=8).sampler
    head.config.match = False  # added after the combiner: test_the_match_term_follows_the_longest_match
    gen = torch.Generator().manual_seed(7)
    n, k, hidden = 3, 5, head.config.hidden_size
    h, embed = torch.randn(n, hidden, generator=gen), torch.randn(VOCAB, hidden, generator=gen)
    prev, slot, cand = torch.tensor([1, 4, 6]), torch.tensor([0, 1, 3]), torch.randint(0, VOCAB, (n, k), generator=gen)
    z, seen, seen3 = torch.randn(n, k, generator=gen), torch.randint(0, 4, (n, k)), torch.randint(0, 3, (n, k))
    with torch.no_grad():
        scores, _ = head.scores(h, prev, slot, cand, z, embed, embed, seen, seen3)
        terms, _ = head.text_free_terms(h, prev, slot, cand, z, embed, embed)
        head.config.combiner = 0
        alone = head.combine(terms, slot, seen, seen3)
        head.config.combiner = 8
        features = torch.stack([z - z.max(-1, keepdim=True).values, terms.pair, torch.log1p(seen.float()),
                                torch.log1p(seen3.float()), terms.mlp, alone - alone.max(-1, keepdim=True).values], -1)
        g = head.combine_out(torch.nn.functional.gelu(head.combine_in(features) + head.combine_position[slot][:, None]))
    assert not torch.allclose(scores, alone)
    assert torch.allclose(scores, alone + g[..., 0], atol=1e-6)


@pytest.mark.parametrize("combiner", [0, 8])
def test_save_and_load_round_trip(tmp_path, combiner):
    head = tiny_sat_model(head=True, combiner=combiner).sampler
    head.save(tmp_path)
    loaded = head_beside(tmp_path)
    assert loaded.config == head.config
    assert len(loaded.state_dict()) == len(head.state_dict())
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert head_beside(tmp_path / "missing") is None


# -- training on a tiny model -----------------------------------------------------------------------

def tiny_features(tmp_path) -> tuple[SatModel, list]:
    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=0)
    config = AdapterConfig(base_model="tiny", hidden_size=32, num_layers=2, num_sats=3, rank=4)
    sat_model = SatModel(model, SatSpec(kind="adapter", max_k=3), SatAdapter.for_model(model, config, 3))
    gen = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(0, 64, (40,), generator=gen).tolist(), 8) for _ in range(12)]
    extract(sat_model, sequences, tmp_path / "features", k=3, stride=1, chunk=4, progress=False)
    return sat_model, load_features(tmp_path / "features", slots=3)


def head_config(tmp_path, out: str, **changes) -> HeadTrainConfig:
    settings = dict(out=str(tmp_path / out), features=str(tmp_path / "features"), width=32, candidates=8, steps=60,
                    batch_size=64, lr=3e-3, warmup=5, slots=3, held_out=0.25, checkpoint_every=20, eval_every=30,
                    context=True, context3=True)
    return HeadTrainConfig(**(settings | changes))


def test_older_features_get_their_context_counts_back(tmp_path):
    from sdsat.train.head import add_seen, merge

    model = make_tiny_llama(vocab_size=64, hidden_size=32, layers=2, seed=0)
    config = AdapterConfig(base_model="tiny", hidden_size=32, num_layers=2, num_sats=3, rank=4)
    sat_model = SatModel(model, SatSpec(kind="adapter", max_k=3), SatAdapter.for_model(model, config, 3))
    gen = torch.Generator().manual_seed(0)
    sequences = [([3, 4, 3, 4] * 5 + torch.randint(0, 64, (12,), generator=gen).tolist(), 6) for _ in range(6)]
    paths = extract(sat_model, sequences, tmp_path, k=3, stride=1, chunk=4, progress=False)
    whole = [torch.load(p) for p in paths]
    assert any(c["seen3"].any() for c in whole)  # the repeated pairs were counted
    older = {name: value for name, value in whole[0].items() if name not in ("seen", "seen3")}
    torch.save(older, paths[0])
    with pytest.raises(ValueError, match="different versions"):
        merge(load_features(tmp_path, slots=3))
    assert add_seen(paths, sequences, k=3, stride=1, chunk=4) == 1
    again = torch.load(paths[0])
    assert torch.equal(again["seen"], whole[0]["seen"]) and torch.equal(again["seen3"], whole[0]["seen3"])


def test_the_head_loss_falls_and_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    sat_model, chunks = tiny_features(tmp_path)
    assert {"sat_hidden", "std_hidden", "cand", "cand_logits", "prev", "target", "slot", "seen",
            "seen3"} <= set(chunks[0])
    embed_in = sat_model.model.get_input_embeddings().weight
    embed_out = sat_model.model.get_output_embeddings().weight
    whole = train(head_config(tmp_path, "whole"), embed_in, embed_out, "tiny", chunks, progress=False)
    losses = [s["loss"] for s in whole["steps"]]
    assert sum(losses[-10:]) < sum(losses[:10]) * 0.9, losses
    train(head_config(tmp_path, "resumed"), embed_in, embed_out, "tiny", chunks, progress=False, stop_at=40)
    resumed = train(head_config(tmp_path, "resumed"), embed_in, embed_out, "tiny", chunks, progress=False)
    assert [s["loss"] for s in resumed["steps"]] == losses
    a, b = SamplerHead.load(tmp_path / "whole" / "head"), SamplerHead.load(tmp_path / "resumed" / "head")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="another configuration"):
        train(head_config(tmp_path, "resumed", lr=1e-3), embed_in, embed_out, "tiny", chunks, progress=False)


def test_a_run_started_from_a_trained_head_trains_its_mlp_beside_the_tables(tmp_path):
    """`init_from`: the tables' weights and bigram-free terms come over; with the tables' own learning rate
    near zero they stay, while the MLP learns; a head of other table terms is refused by name."""
    sat_model, chunks = tiny_features(tmp_path)
    embed_in = sat_model.model.get_input_embeddings().weight
    embed_out = sat_model.model.get_output_embeddings().weight
    train(head_config(tmp_path, "tables", width=0, lr=0.05), embed_in, embed_out, "tiny", chunks, progress=False)
    tables = SamplerHead.load(tmp_path / "tables" / "head")
    assert tables.context_weight.abs().sum() > 0
    start = head_config(tmp_path, "mlp", init_from=str(tmp_path / "tables" / "head"), table_lr=1e-12)
    record = train(start, embed_in, embed_out, "tiny", chunks, progress=False)
    losses = [s["loss"] for s in record["steps"]]
    assert sum(losses[-10:]) < sum(losses[:10]), losses
    trained = SamplerHead.load(tmp_path / "mlp" / "head")
    assert trained.out.weight.abs().sum() > 0
    for name in ("pair_weight", "context_weight", "context3_weight"):
        assert torch.allclose(getattr(trained, name), getattr(tables, name), atol=1e-6), name
    with pytest.raises(ValueError, match="context3"):
        train(head_config(tmp_path, "other", init_from=str(tmp_path / "tables" / "head"), context3=False),
              embed_in, embed_out, "tiny", chunks, progress=False)
    with pytest.raises(ValueError, match="table_lr"):
        head_config(tmp_path, "bad", table_lr=-1.0).validate()


def test_a_run_started_from_a_head_scores_as_that_head_before_its_first_step(tmp_path):
    from sdsat.head import HeadConfig
    from sdsat.train.head import _start_from

    gen = torch.Generator().manual_seed(3)
    trained = SamplerHead(HeadConfig(base_model="tiny", hidden_size=32, num_sats=3, width=0, candidates=8,
                                     context=True, context3=True))
    with torch.no_grad():
        for weight in (trained.pair_weight, trained.context_weight, trained.context3_weight):
            weight.copy_(torch.rand(3, generator=gen))
    fresh = SamplerHead(HeadConfig(base_model="tiny", hidden_size=32, num_sats=3, width=16, candidates=8,
                                   context=True, context3=True))
    _start_from(fresh, trained)
    h, embed = torch.randn(5, 32, generator=gen), torch.randn(64, 32, generator=gen)
    prev, slot = torch.randint(0, 64, (5,), generator=gen), torch.tensor([0, 1, 2, 0, 1])
    cand = torch.randint(0, 64, (5, 8), generator=gen)
    z, seen = torch.randn(5, 8, generator=gen), torch.randint(0, 3, (5, 8), generator=gen)
    a, _ = fresh.scores(h, prev, slot, cand, z, embed, embed, seen, seen)
    b, _ = trained.scores(h, prev, slot, cand, z, embed, embed, seen, seen)
    assert torch.equal(a, b)
    # the tables' weights are per SAT position, so a head of more candidates (and a combiner) may start from them
    wider = SamplerHead(HeadConfig(base_model="tiny", hidden_size=32, num_sats=3, width=16, candidates=16,
                                   context=True, context3=True, combiner=8))
    _start_from(wider, trained)
    assert torch.equal(wider.context3_weight, trained.context3_weight)
    cand16, z16, seen16 = (torch.cat([x, x], -1) for x in (cand, z, seen))
    a, _ = wider.scores(h, prev, slot, cand16, z16, embed, embed, seen16, seen16)
    assert torch.allclose(a, torch.cat([b, b], -1))  # the combiner starts at 0: the tables' scores


def test_the_mlps_dropout_acts_in_training_only(tmp_path):
    from sdsat.head import HeadConfig

    head = SamplerHead(HeadConfig(base_model="tiny", hidden_size=32, num_sats=3, width=64, dropout=0.5))
    with torch.no_grad():
        head.out.weight.normal_()
    gen = torch.Generator().manual_seed(0)
    h, prev, slot = torch.randn(4, 32, generator=gen), torch.randn(4, 32, generator=gen), torch.tensor([0, 1, 2, 0])
    head.train()
    assert not torch.equal(head.correction(h, prev, slot), head.correction(h, prev, slot))
    head.save(tmp_path)
    loaded = SamplerHead.load(tmp_path)  # loads for decoding: no dropout
    assert loaded.config.dropout == 0.5 and torch.equal(loaded.correction(h, prev, slot),
                                                        loaded.correction(h, prev, slot))
    with pytest.raises(ValueError, match="dropout"):
        HeadTrainConfig(dropout=1.0).validate()


def test_the_drafts_benchmark_reads_the_head_as_decoding_does():
    """`along_head` without a head gives `along`'s logits; with one, each SAT's row is the head's, conditioned on
    the output token before the drafted one (for SAT 1, t)."""
    from sdsat.bench.drafts import along, along_head

    plain, headed = tiny_sat_model(head=False), tiny_sat_model(head=True)
    output = [4, 1, 6, 2, 2, 7, 0, 3]
    teacher, student, truth = along(plain, PROMPT, output, 3)
    teacher2, student2, truth2 = along_head(plain, PROMPT, output, 3)
    assert torch.allclose(teacher, teacher2, atol=1e-5) and torch.allclose(student, student2, atol=1e-5)
    assert torch.equal(truth, truth2)
    _, conditioned, _ = along_head(headed, PROMPT, output, 3)
    model = headed.model
    seq = PROMPT + output
    run, j = 2, 1  # run after position len(PROMPT) - 1 + run; SAT j + 1 is conditioned on the token at that + 1 + j
    hidden = headed.hidden_states(torch.tensor([seq[:len(PROMPT) + run] + [0] * 3]),
                                  torch.tensor([[-1] * (len(PROMPT) + run) + [0, 1, 2]]))[0, -3:]
    expected = headed.sampler.logits(hidden[j:j + 1], headed.head(hidden[j:j + 1]),
                                     torch.tensor([seq[len(PROMPT) + run + j]]), torch.tensor([j]),
                                     model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                                     torch.tensor(seq), torch.tensor([len(PROMPT) + run + j]))
    finite = torch.isfinite(expected[0])
    assert torch.equal(finite, torch.isfinite(conditioned[run, j]))
    assert torch.allclose(expected[0][finite], conditioned[run, j][finite], atol=1e-4)


def test_the_shipped_drafter_loads_and_its_greedy_output_equals_vanillas(default_engine):
    """The default adapter ships with its sampler head: the engine drafts through it, and greedy SDSAT output is
    vanilla's, token for token, on code and on chat."""
    engine = default_engine
    assert engine.sat_model.sampler is not None
    for prompt, chat in (("def fibonacci(n):\n    ", False), ("Give three tips about saving money.", True)):
        ids = engine.encode(prompt, chat=chat)
        vanilla = collect(engine.stream(ids, DecodeConfig(method="vanilla", max_new_tokens=40)))
        for config in (DecodeConfig(method="sdsat", k=3, max_new_tokens=40),
                       DecodeConfig(method="sdsat", k=2, tree_candidates=2, max_new_tokens=40)):
            sdsat = collect(engine.stream(ids, config))
            assert sdsat.token_ids == vanilla.token_ids
            assert any(step.conditioned for step in sdsat.steps)


def test_the_step_explorer_says_what_each_draft_was_conditioned_on():
    from sdsat.records import StepRecord
    from sdsat.ui.explorer import _conditioned_on

    common = dict(index=0, kind="sat", kv_len_before=5, draft_pass=True, k=3, drafts=[11, 12, 13],
                  draft_probs=[0.9, 0.5, 0.2], predictions=[11, 99, 7, 8], accepted=1, tokens=[10, 11, 99],
                  sources=["verified", "draft", "bonus"], probs=[0.8, 0.7, 0.6], pass_seconds=[0.1, 0.1], kv_len=8,
                  elapsed=0.2)
    headed, blind = StepRecord(**common, conditioned=True), StepRecord(**common)
    assert _conditioned_on(headed, 1) == " · after t" and _conditioned_on(headed, 3) == " · after d2"
    assert "conditioned on t" in _conditioned_on(headed, 1, long=True)
    assert _conditioned_on(blind, 2) == "" and "blind to t" in _conditioned_on(blind, 2, long=True)
