"""Greedy SDSAT against the trusted references, on tiny random Llama models.

Greedy SDSAT must equal vanilla greedy decoding and `model.generate(do_sample=False)` token for
token, for every k, with both kinds of SAT weights, whatever stops it (EOS, token budget, stop
string, cancellation). The per-iteration records must add up and the cache must hold exactly the
tokens accepted so far.

A tiny random model drafts almost nothing right, which would leave the acceptance paths untested.
So the model here has a favourite token: a constant feature in every embedding that the output
layer reads as a vote for FAVOURITE. Its greedy output mixes runs of FAVOURITE (which SATs that
look like FAVOURITE draft correctly) with other tokens (which they get wrong), so iterations
accept none, some or all of their drafts.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from conftest import make_tiny_llama
from transformers import DynamicCache

from sdsat.decoding import SCHEMES, DecodeConfig, GenerationResult, StepRecord, decode, collect
from sdsat.drafters import LookupGate, leading_matches, lookup_continuation
from sdsat.verify import verify_tree
from sdsat.sampling import SamplingConfig, TokenChooser
from sdsat.sat import AdapterConfig, SatAdapter, SatModel, SatSpec
from sdsat.tree import MAX_EXTRA as MAX_TREE_CANDIDATES
from sdsat.tree import DraftTree

VOCAB = 64
FAVOURITE = 7
MAX_K = 8
KINDS = ("adapter", "vocab")


class PieceTokenizer:
    """Token i decodes to a fixed piece of one to three letters, so stop strings can span tokens."""

    pieces = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(self.pieces[i] for i in ids)


TOKENIZER = PieceTokenizer()


def favourite_llama() -> torch.nn.Module:
    model = make_tiny_llama(vocab_size=VOCAB, seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.05  # a feature every token carries...
        model.lm_head.weight[FAVOURITE, 0] = 0.1  # ...read as a vote for FAVOURITE
    model.generation_config.eos_token_id = None  # each test says which EOS ids it wants
    return model


def random_adapter(model: torch.nn.Module, noise: float, seed: int = 1) -> SatAdapter:
    """An adapter with non-zero LoRA weights: SAT embeddings near FAVOURITE's, plus `noise`."""
    config = AdapterConfig(base_model="tiny", hidden_size=model.config.hidden_size,
                           num_layers=model.config.num_hidden_layers, num_sats=MAX_K, rank=4)
    adapter = SatAdapter.for_model(model, config, init_token_id=FAVOURITE)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        adapter.embeddings.add_(torch.randn(adapter.embeddings.shape, generator=gen) * noise)
        for b in adapter.lora_b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * noise)
    return adapter


def make_sat_model(kind: str) -> SatModel:
    model = favourite_llama()
    if kind == "adapter":
        return SatModel(model, SatSpec(kind="adapter", max_k=MAX_K), random_adapter(model, noise=0.003))
    # The paper's kind: ordinary vocabulary rows serve as SATs (ids may repeat, as 32011 does).
    return SatModel(model, SatSpec(kind="vocab", sat_ids=[FAVOURITE, 9, 3], max_k=MAX_K))


@pytest.fixture(scope="module", params=KINDS)
def sat_model(request) -> SatModel:
    return make_sat_model(request.param)


def random_prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 13))] for _ in range(count)]


def greedy(method: str, k: int = 1, max_new_tokens: int = 24, stop_strings: tuple[str, ...] = ()) -> DecodeConfig:
    return DecodeConfig(method=method, k=k, max_new_tokens=max_new_tokens, stop_strings=list(stop_strings))


def generate_reference(model, prompt: list[int], max_new_tokens: int, eos: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=eos or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_records(result: GenerationResult, prompt: list[int], sdsat: bool, scheme: str = "two_step",
                  lookup: bool = False) -> None:
    """The records add up, and after every iteration the cache holds exactly the accepted tokens.

    Fused scheme: only the first iteration has a draft pass (and a "verified" token); later ones
    are one pass that emits accepted drafts and the bonus. With prompt lookup, an iteration whose
    copies were found before any pass has no draft pass (the lookup test checks which ones).
    """
    steps = result.steps
    passes = verified = 0
    assert [t for s in steps for t in s.tokens] == result.token_ids
    assert sum(len(s.tokens) for s in steps) == len(result.token_ids)
    assert [s.index for s in steps] == list(range(len(steps)))
    emitted = 0
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        assert step.kv_len_before == (0 if i == 0 else len(prompt) + emitted - 1)
        assert len(step.sources) == len(step.tokens) == len(step.probs) and step.tokens
        if not sdsat:
            assert (step.k, step.drafts, step.accepted, step.sources, step.draft_source) == (0, [], 0, ["verified"], "")
            assert step.forward_passes == 1
            passes, verified = passes + 1, verified + 1
            assert step.kv_len == len(prompt) + emitted  # everything but the token just chosen
        else:
            # A draft tree shows the path it walked, shorter than k when it ended in a childless runner-up.
            assert len(step.drafts) == len(step.draft_probs) == step.k or (
                step.candidates > step.k and 1 <= len(step.drafts) == len(step.draft_probs) < step.k)
            assert len(step.predictions) == len(step.drafts) + 1
            assert 0 <= step.accepted <= len(step.drafts)
            # Greedy verification: accepted drafts are the model's own choices, the first rejected is not.
            assert step.drafts[:step.accepted] == step.predictions[:step.accepted]
            if step.accepted < len(step.drafts):
                assert step.drafts[step.accepted] != step.predictions[step.accepted]
            # This iteration began with a draft pass (not when prompt lookup supplied the drafts).
            drafted = (step.sources[0] == "verified" if lookup
                       else step.draft_source == "sat" and (scheme == "two_step" or i == 0))
            passes += 2 if drafted else 1
            verified += drafted
            # The record says so itself: whether a draft pass ran, and what kind of iteration it was.
            assert step.draft_pass == drafted and step.forward_passes == 1 + drafted
            assert step.kind == ("fused" if scheme == "fused" else "tree" if step.tree_paths
                                 else "sat" if step.draft_source == "sat"
                                 else "lookup_after_draft" if drafted else "lookup_direct")
            head = ["verified"] if drafted else []
            full = head + ["draft"] * step.accepted + ["bonus"]
            # Only the last iteration may be cut short (by EOS, the token budget or a stop string).
            assert step.sources == (full[:len(step.tokens)] if last else full)
            assert (step.tokens[len(head):len(head) + step.accepted]
                    == step.drafts[:step.accepted][:len(step.tokens) - len(head)])
            if len(step.tokens) == len(full):
                assert step.tokens[-1] == step.predictions[step.accepted]  # the bonus
            assert step.forward_passes == (2 if drafted else 1)
            # In the cache: prompt, earlier tokens, t (or the last bonus) and the accepted drafts.
            assert step.kv_len == len(prompt) + emitted + len(head) + step.accepted
            if not last:
                assert step.kv_len == len(prompt) + emitted + len(step.tokens) - 1
        emitted += len(step.tokens)
    assert result.forward_passes == passes
    if scheme == "fused":
        assert passes == len(steps) + 1
    counts = Counter(src for s in steps for src in s.sources)
    assert counts["verified"] == verified
    assert counts["verified"] + counts["draft"] + counts["bonus"] == len(result.token_ids)
    assert counts["draft"] <= sum(s.accepted for s in steps)


def test_greedy_sdsat_equals_vanilla_and_generate(sat_model: SatModel):
    model = sat_model.model
    stats: Counter = Counter()
    for n, prompt in enumerate(random_prompts(seed=0, count=8)):
        budget = 12 + 5 * n % 17  # 12..28 new tokens, so the budget ends at many offsets
        free = collect(decode(sat_model, TOKENIZER, prompt, greedy("vanilla", max_new_tokens=budget), eos_ids=[]))
        # An EOS the model really emits, so decoding has to stop on it.
        eos = [free.token_ids[len(free.token_ids) // 2]]
        for eos_ids in ([], eos):
            reference = generate_reference(model, prompt, budget, eos_ids)
            vanilla = collect(decode(sat_model, TOKENIZER, prompt, greedy("vanilla", max_new_tokens=budget), eos_ids))
            assert vanilla.token_ids == reference
            assert vanilla.stop_reason == ("eos" if eos_ids else "max_new_tokens")
            check_records(vanilla, prompt, sdsat=False)
            for k, scheme in itertools.product(range(1, MAX_K + 1), SCHEMES):
                config = replace(greedy("sdsat", k, budget), scheme=scheme)
                sdsat = collect(decode(sat_model, TOKENIZER, prompt, config, eos_ids))
                assert sdsat.token_ids == reference, f"k={k} scheme={scheme} prompt={prompt} eos={eos_ids}"
                assert (sdsat.text, sdsat.stop_reason) == (vanilla.text, vanilla.stop_reason)
                check_records(sdsat, prompt, sdsat=True, scheme=scheme)
                stats["accepted"] += sum(s.accepted for s in sdsat.steps)
                stats["rejected"] += sum(len(s.rejected) for s in sdsat.steps)
                last = sdsat.steps[-1]
                if last.sources[-1] == "draft":  # decoding stopped on an accepted draft
                    stats[f"stop on draft: {sdsat.stop_reason}"] += 1
                    if len(last.tokens) - 1 < last.accepted:  # and later accepted drafts were dropped
                        stats[f"drafts dropped: {sdsat.stop_reason}"] += 1
    # The paths worth testing really ran: acceptance, rejection, and stops in the middle of a draft.
    assert stats["accepted"] > 100 and stats["rejected"] > 100, stats
    assert stats["stop on draft: eos"] > 0 and stats["stop on draft: max_new_tokens"] > 0, stats
    assert stats["drafts dropped: eos"] > 0 and stats["drafts dropped: max_new_tokens"] > 0, stats


def test_lookup_copies_after_the_first_occurrence_of_the_longest_recurring_suffix():
    assert lookup_continuation([5, 6, 7, 1, 5, 6, 9, 2, 5, 6], ngram=2, max_tokens=3) == [7, 1, 5]  # the first "5 6"
    # "2 3"; a lone "3" does not count
    assert lookup_continuation([1, 2, 3, 9, 3, 4, 8, 2, 3], ngram=2, max_tokens=2) == [9, 3]
    # "2 3" beats an earlier "3"
    assert lookup_continuation([3, 5, 2, 3, 9, 3, 4, 8, 2, 3], ngram=1, max_tokens=2) == [9, 3]
    # only "3" recurs: the first
    assert lookup_continuation([1, 2, 3, 9, 3, 4, 8, 0, 3], ngram=1, max_tokens=2) == [9, 3]
    # "4 7 9 4" recurs: a full copy
    assert lookup_continuation([9, 4, 7, 9, 4, 7, 9, 4], ngram=2, max_tokens=3) == [7, 9, 4]
    # "1 2 3" beats an earlier "2 3"
    assert lookup_continuation([2, 3, 8, 1, 2, 3, 7, 9, 1, 2, 3], ngram=2, max_tokens=2) == [7, 9]
    # 4 tokens recur (the longest tried)
    assert lookup_continuation([5, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4], ngram=2, max_tokens=1) == [6]
    assert lookup_continuation([4, 5, 6, 5], ngram=2, max_tokens=4) == []  # "6 5" never occurred ("5" alone did)
    assert lookup_continuation([7, 7, 7], ngram=2, max_tokens=4) == [7]  # the continuation stops at the end
    assert lookup_continuation([3], ngram=2, max_tokens=4) == []  # shorter than the n-gram


def test_greedy_sdsat_with_prompt_lookup_equals_vanilla(sat_model: SatModel):
    stats: Counter = Counter()
    for n, prompt in enumerate(random_prompts(seed=3, count=6)):
        prompt = prompt + prompt[:4]  # a repeat, so lookup has something to copy from the start
        budget = 16 + 3 * n
        vanilla = greedy("vanilla", max_new_tokens=budget)
        reference = collect(decode(sat_model, TOKENIZER, prompt, vanilla, [])).token_ids
        for k, lookup, ngram in itertools.product((1, 3), (1, 4), (1, 2)):  # ngram 1: weak hints, often rejected
            config = replace(greedy("sdsat", k, budget), lookup_tokens=lookup, lookup_ngram=ngram)
            result = collect(decode(sat_model, TOKENIZER, prompt, config, []))
            assert result.token_ids == reference, f"k={k} lookup={lookup} ngram={ngram} prompt={prompt}"
            check_records(result, prompt, sdsat=True, lookup=True)
            emitted: list[int] = []
            gate = LookupGate(lookup, k)  # the rules the decoder follows, fed what each step shows
            for step in result.steps:
                # Copies of what followed the recurring tail: found before any pass (then verified in one
                # pass), or else after the draft pass's token (then verified in place of the SAT drafts);
                # never more than the tokens still to emit, the bonus aside, nor more than the gate lets through.
                room = budget - len(emitted) - 1
                before = (lookup_continuation(prompt + emitted, ngram, min(lookup, room))
                          if room > 0 and step.index else [])
                after = (lookup_continuation(prompt + emitted + step.tokens[:1], ngram, min(lookup, room - 1))
                         if room > 1 else [])
                direct = bool(before) and gate.pays(direct=True)
                copied = direct or (bool(after) and gate.pays(direct=False))
                assert step.forward_passes == (1 if direct else 2)
                if copied:
                    assert (step.draft_source, step.drafts) == ("lookup", (before if direct else after)[:gate.length()])
                    assert step.draft_probs == [1.0] * step.k
                    gate.saw_copies(step.accepted)
                    stats["lookup accepted"] += step.accepted
                    stats["lookup rejected"] += len(step.rejected)
                    stats["lookup after the draft pass"] += not direct
                    stats["copies cut short"] += step.k < len(before if direct else after)
                else:
                    assert (step.draft_source, step.k) == ("sat", k)
                    gate.saw_drafts(step.accepted)
                    if after or before:  # found, not verified: scored against what the step gave from there
                        gate.saw_copies(leading_matches(after, step.tokens[1:]) if after
                                        else leading_matches(before, step.tokens))
                        stats["copies not verified"] += 1
                stats[step.draft_source] += 1
                emitted += step.tokens
    assert stats["lookup"] > 20 and stats["sat"] > 20, stats  # both sources drafted
    assert stats["lookup accepted"] > 10 and stats["lookup rejected"] > 5, stats
    assert stats["lookup after the draft pass"] > 5, stats
    assert stats["copies not verified"] > 5 and stats["copies cut short"] > 5, stats  # the gate acted both ways


def test_head_of_hidden_states_is_forward_and_fused_works_without_it(sat_model: SatModel, monkeypatch):
    """The fused scheme projects chosen rows itself; that must equal forward's logits, and models whose
    head is not a plain projection take forward's path with the same greedy output."""
    from sdsat.layout import SatLayout

    layout = SatLayout.runs_at(4, torch.arange(4), 3)
    block = torch.tensor([[5, 9, 11, 2] + [0] * layout.num_sats])
    inputs = dict(input_ids=block, sat_slots=layout.sat_slots, attention_mask=layout.attention_mask(),
                  position_ids=layout.position_ids)
    with torch.inference_mode():
        assert sat_model.plain_head  # a Llama
        torch.testing.assert_close(sat_model.head(sat_model.hidden_states(**inputs)), sat_model.forward(**inputs))
    prompt = random_prompts(seed=3, count=1)[0]
    config = replace(greedy("sdsat", 3, 20), scheme="fused")
    projected = collect(decode(sat_model, TOKENIZER, prompt, config, eos_ids=[]))
    monkeypatch.setattr(SatModel, "_PLAIN_HEAD_TYPES", ())
    assert not sat_model.plain_head
    whole = collect(decode(sat_model, TOKENIZER, prompt, config, eos_ids=[]))
    reference = collect(decode(sat_model, TOKENIZER, prompt, greedy("vanilla", max_new_tokens=20), eos_ids=[]))
    assert projected.token_ids == whole.token_ids == reference.token_ids
    assert [s.accepted for s in projected.steps] == [s.accepted for s in whole.steps]


def first_stop(tokens: list[int], stop: str) -> list[int]:
    """The shortest prefix of `tokens` whose text contains `stop`: where vanilla must stop."""
    for n in range(1, len(tokens) + 1):
        if stop in TOKENIZER.decode(tokens[:n]):
            return tokens[:n]
    raise AssertionError(f"{stop!r} not in the output")


def test_stop_string_cuts_where_vanilla_stops(sat_model: SatModel):
    cuts = Counter()
    for n, prompt in enumerate(random_prompts(seed=1, count=6)):
        free = collect(decode(sat_model, TOKENIZER, prompt, greedy("vanilla", max_new_tokens=24), eos_ids=[])).token_ids
        # A stop string spanning two tokens: the end of one piece and the start of the next.
        j = 3 + n % 10
        stop = TOKENIZER.pieces[free[j]][-1] + TOKENIZER.pieces[free[j + 1]][0]
        expected = first_stop(free, stop)
        for method, k in [("vanilla", 1)] + [("sdsat", k) for k in (1, 3, 5, 8)]:
            result = collect(decode(sat_model, TOKENIZER, prompt, greedy(method, k, 24, (stop,)), eos_ids=[]))
            assert result.token_ids == expected, f"{method} k={k} stop={stop!r}"
            assert result.stop_reason == "stop_string"
            check_records(result, prompt, sdsat=method == "sdsat")
            cuts[result.steps[-1].sources[-1]] += 1
    assert cuts["draft"] > 0, cuts  # some stop string ended inside an accepted draft


@pytest.mark.parametrize("method", ["vanilla", "sdsat"])
def test_should_stop_cancels_between_iterations(sat_model: SatModel, method: str):
    prompt = random_prompts(seed=2, count=1)[0]
    full = collect(decode(sat_model, TOKENIZER, prompt, greedy("vanilla", max_new_tokens=40), eos_ids=[])).token_ids
    calls = []

    def should_stop() -> bool:
        calls.append(1)
        return len(calls) == 3

    result = collect(decode(sat_model, TOKENIZER, prompt, greedy(method, 4, 40), eos_ids=[], should_stop=should_stop))
    assert result.stop_reason == "cancelled"
    assert len(result.steps) == len(calls) == 3
    assert 0 < len(result.token_ids) < len(full)
    assert result.token_ids == full[:len(result.token_ids)]
    check_records(result, prompt, sdsat=method == "sdsat")


def test_stream_yields_each_record_then_the_result(sat_model: SatModel):
    prompt = random_prompts(seed=3, count=1)[0]
    events = list(decode(sat_model, TOKENIZER, prompt, greedy("sdsat", 5, 20), eos_ids=[]))
    *steps, result = events
    assert all(isinstance(e, StepRecord) for e in steps) and isinstance(result, GenerationResult)
    assert steps == result.steps
    assert result.to_dict()["token_ids"] == result.token_ids


def test_k_outside_the_spec_is_refused(sat_model: SatModel):
    for k in (0, MAX_K + 1):
        with pytest.raises(ValueError, match=f"between 1 and {MAX_K}"):
            decode(sat_model, TOKENIZER, [5, 6], greedy("sdsat", k), eos_ids=[])
    for settings, message in [(dict(lookup_tokens=65), "lookup_tokens must be between 0 .off. and 64"),
                              (dict(lookup_tokens=-1), "lookup_tokens must be between 0 .off. and 64"),
                              (dict(lookup_tokens=4, scheme="fused"), "two_step scheme only"),
                              (dict(lookup_tokens=4, lookup_ngram=0), "lookup_ngram must be between 1 and 8")]:
        with pytest.raises(ValueError, match=message):
            decode(sat_model, TOKENIZER, [5, 6], replace(greedy("sdsat", 2), **settings), eos_ids=[])


def test_adapter_leaves_standard_tokens_bit_identical():
    base = favourite_llama()
    plain = torch.tensor([random_prompts(seed=4, count=1)[0] + [3, 4, 5]])  # (1, T)
    k = 4
    tail = torch.tensor([[11] * k])  # stands where the SATs will be; causal rows before it never see it
    with torch.inference_mode():
        want = base(input_ids=plain).logits
        want_with_tail = base(input_ids=torch.cat([plain, tail], 1)).logits[:, :plain.shape[1]]
    adapter = random_adapter(base, noise=0.5)  # large weights: any leak into standard rows would show
    sat_model = SatModel(base, SatSpec(kind="adapter", max_k=MAX_K), adapter)
    slots = torch.cat([torch.full(plain.shape, -1), sat_model.sat_block(k)[None]], 1)
    with torch.inference_mode():
        assert torch.equal(base(input_ids=plain).logits, want)
        assert torch.equal(sat_model.forward(plain), want)
        with_sats = sat_model.forward(torch.cat([plain, tail], 1), slots)
    assert torch.equal(with_sats[:, :plain.shape[1]], want_with_tail)
    # The SAT rows do differ from plain tokens: the adapter is really in play.
    with torch.inference_mode():
        assert not torch.allclose(with_sats[:, plain.shape[1]:],
                                  base(input_ids=torch.cat([plain, tail], 1)).logits[:, plain.shape[1]:])
    adapter.detach()
    with torch.inference_mode():
        assert torch.equal(base(input_ids=plain).logits, want)


def test_greedy_sdsat_with_a_draft_tree_equals_vanilla(sat_model: SatModel):
    """Runner-up candidates ride in the verify pass; accepting one moves its cache rows into place."""
    stats: Counter = Counter()
    for n, prompt in enumerate(random_prompts(seed=5, count=6)):
        budget = 14 + 3 * n
        vanilla = greedy("vanilla", max_new_tokens=budget)
        reference = collect(decode(sat_model, TOKENIZER, prompt, vanilla, [])).token_ids
        cases = [(k, extra, lookup, False)
                 for k, extra, lookup in itertools.product((1, 2, 3, 5), (1, 2, MAX_TREE_CANDIDATES), (0, 4))]
        for k, extra, lookup, adaptive in cases + [(5, 3, 0, True), (4, MAX_TREE_CANDIDATES, 4, True)]:
            config = replace(greedy("sdsat", k, budget), tree_candidates=extra, lookup_tokens=lookup,
                             adaptive_k=adaptive)
            result = collect(decode(sat_model, TOKENIZER, prompt, config, []))
            assert result.token_ids == reference, (f"k={k} tree={extra} lookup={lookup} adaptive={adaptive} "
                                                   f"prompt={prompt}")
            check_records(result, prompt, sdsat=True, lookup=bool(lookup))
            for step in result.steps:
                if step.draft_source == "lookup":
                    assert step.draft_ranks == [] and step.candidates == step.k
                    continue
                tree = DraftTree.for_k(step.k, extra)  # adaptive k: this iteration's k
                assert step.candidates == len(tree.paths) and (adaptive or step.k == k)
                assert tuple(step.draft_ranks) in tree.paths  # the path shown is a path of the tree
                assert len(step.draft_ranks) == len(step.drafts) <= step.k
                # Every node is recorded, and the walked path is made of them.
                assert step.tree_paths == [list(p) for p in tree.paths] and len(step.tree_tokens) == step.candidates
                for i, token in enumerate(step.drafts):
                    assert step.tree_tokens[step.tree_paths.index(step.draft_ranks[:i + 1])] == token
                stats["runner-up accepted"] += any(step.draft_ranks[:step.accepted])
                stats["runner-up accepted on a longer path"] += (any(step.draft_ranks[:step.accepted])
                                                                 and step.accepted > 1)
    assert stats["runner-up accepted"] > 10, stats  # the branches really were taken (and their rows moved)
    assert stats["runner-up accepted on a longer path"] > 0, stats


def test_tree_pass_keeps_the_accepted_rows_as_a_plain_pass_would():
    """After a runner-up is accepted, the cache equals the cache of feeding [t, accepted] plainly."""
    sat_model = make_sat_model("adapter")
    model = sat_model.model
    prompt = [3, 9, 12, 5, 30]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        t = 11
        # The SATs' q put the model's own next tokens in second place at depth 1 and first at depth 2.
        ref = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt]), cache=ref, use_cache=True)
        nxt = int(model(input_ids=torch.tensor([[t]]), cache=ref, use_cache=True).logits[0, -1].argmax())
        after = int(model(input_ids=torch.tensor([[nxt]]), cache=ref, use_cache=True).logits[0, -1].argmax())
        then = int(model(input_ids=torch.tensor([[after]]), cache=ref, use_cache=True).logits[0, -1].argmax())
        q = torch.full((2, VOCAB), 1e-3)
        q[0, (nxt + 1) % VOCAB], q[0, nxt] = 0.5, 0.4
        q[1, after] = 0.5
        tree = DraftTree(((0,), (0, 0), (1,), (1, 0)))
        tokens, ranks = tree.node_tokens(q.topk(tree.width, dim=-1).indices), [path[-1] for path in tree.paths]
        verdict = verify_tree(sat_model, TokenChooser(SamplingConfig(), torch.device("cpu")), cache, t, tokens, tree)
    assert (verdict.accepted, verdict.shown, [ranks[i] for i in verdict.shown_rows]) == (2, [nxt, after], [1, 0])
    nodes = verdict.node_tokens
    assert len(nodes) == 4 and nodes[2] == nxt and nodes[3] == after  # (1,) and (1, 0) in the tree's order
    assert verdict.p.shape[0] == 3 and int(verdict.p[2].argmax()) == verdict.bonus == then
    assert cache.get_seq_length() == len(prompt) + 3 == ref.get_seq_length()
    for mine, theirs in zip(cache.layers, ref.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_draft_tree_shape_mask_and_walk():
    tree = DraftTree.for_k(3, 2)
    assert tree.paths == ((0,), (0, 0), (0, 0, 0), (1,), (0, 1))  # the chain first, then runner-ups by likelihood
    assert DraftTree.for_k(1, 3).paths == ((0,), (1,), (2,), (3,))  # only what fits within depth k
    assert tree.parents == [-1, 0, 1, -1, 0]
    allowed = tree.attention_mask[0, 0]
    assert allowed[5].tolist() == [True, True, False, False, False, True]  # (0, 1) sees t, (0,) and itself
    assert allowed[4].tolist() == [True, False, False, False, True, False]
    assert tree.position_offsets.tolist() == [[0, 1, 2, 3, 1, 2]]
    tokens = [10, 20, 30, 11, 21]
    # The model wants 11 after t, then 50: the runner-up (1,) is accepted, the walk stops below it.
    assert tree.walk([11, 0, 0, 0, 50, 0], tokens) == ([3], [3])
    # 10, then 21 (the runner-up at depth 2), then anything: (0,), (0, 1) accepted.
    assert tree.walk([10, 21, 0, 0, 0, 7], tokens) == ([0, 4], [0, 4])
    # Nothing accepted: the shown path is the chain, the draft the model turned down first.
    assert tree.walk([99, 0, 0, 0, 0, 0], tokens) == ([], [0, 1, 2])
    with pytest.raises(ValueError, match="parent"):
        DraftTree(((0, 1),))
    with pytest.raises(ValueError, match="tree_candidates must be between 0 and"):
        DraftTree.for_k(3, MAX_TREE_CANDIDATES + 1)


def test_sampling_verifies_the_tree_and_bad_tree_settings_are_refused(sat_model: SatModel):
    config = replace(greedy("sdsat", 3, 16), tree_candidates=2,
                     sampling=SamplingConfig(do_sample=True, temperature=0.8, seed=3))
    result = collect(decode(sat_model, TOKENIZER, [4, 5, 6], config, []))
    # Every node verified; each accept test in the record, siblings of a depth in draw order (the last step's
    # are cut at the stop).
    assert all(s.candidates == 5 and s.tree_paths for s in result.steps)
    for step in result.steps[:-1]:
        depths = [test.depth for test in step.accept_tests]
        assert depths and depths == sorted(depths)
        assert sum(test.accepted for test in step.accept_tests) == step.accepted
    for bad, message in ((dict(tree_candidates=MAX_TREE_CANDIDATES + 1),
                          "tree_candidates must be between 0 \\(off\\) and"),
                         (dict(tree_candidates=-1), "tree_candidates must be between"),
                         (dict(tree_candidates=2, scheme="fused"),
                          "tree_candidates works with the two_step scheme only")):
        with pytest.raises(ValueError, match=message):
            collect(decode(sat_model, TOKENIZER, [4, 5, 6], replace(greedy("sdsat", 3, 16), **bad), []))


@pytest.mark.parametrize("max_new_tokens", range(1, 9))
def test_accept_tests_past_the_stop_are_not_recorded(sat_model: SatModel, max_new_tokens):
    """The explorer lists what decided the tokens shown: a test that decided a token past the stop is cut."""
    config = replace(greedy("sdsat", 3, max_new_tokens), tree_candidates=2,
                     sampling=SamplingConfig(do_sample=True, temperature=1.5, seed=max_new_tokens))
    result = collect(decode(sat_model, TOKENIZER, [4, 5, 6], config, []))
    assert len(result.token_ids) == max_new_tokens
    for step in result.steps:
        decided = len(step.tokens) - step.sources.count("verified")  # tokens after t: drafts and the bonus
        assert all(test.depth <= decided for test in step.accept_tests), (step.tokens, step.accept_tests)
        if step is not result.steps[-1] and step.draft_pass:  # uncut: a test up to the bonus (none after a leaf)
            assert max(test.depth for test in step.accept_tests) == min(decided, len(step.drafts))


class _RandomDrafter:
    """A drafter that proposes random tokens after a plain verify start: the loop must not care."""

    def __init__(self, vocab: int, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.observed: list[int] = []

    def propose(self, ctx):
        from sdsat.drafters import Proposal, draft_pass

        if len(ctx.pending) > 1:  # the prompt: one draft pass puts it in the cache and gives t
            t, p_t, q, seconds = draft_pass(ctx, 1)
            start, certain, certain_probs, draft_seconds = t, [t], [p_t], seconds
        else:
            start, certain, certain_probs, draft_seconds = ctx.pending[0], [], [], None
        drafts = torch.randint(0, self.vocab, (3,), generator=self.gen)
        return Proposal(kind="lookup_direct" if draft_seconds is None else "sat", start=start, k=3, drafts=drafts,
                        q=None, certain=certain, certain_probs=certain_probs, draft_pass_seconds=draft_seconds)

    def observe(self, proposal, verdict):
        self.observed.append(verdict.accepted)


def test_any_drafter_behind_the_interface_decodes_exactly_as_vanilla(sat_model: SatModel, monkeypatch):
    """Verification is what guarantees the output: a drafter that proposes junk changes speed, never tokens."""
    drafters = []
    monkeypatch.setattr("sdsat.decoding.drafter_for",
                        lambda config: drafters.append(_RandomDrafter(VOCAB, len(drafters))) or drafters[-1])
    for prompt in random_prompts(seed=5, count=3):
        reference = collect(decode(sat_model, TOKENIZER, prompt, greedy("vanilla", max_new_tokens=20), eos_ids=[]))
        result = collect(decode(sat_model, TOKENIZER, prompt, greedy("sdsat", 3, 20), eos_ids=[]))
        assert result.token_ids == reference.token_ids
        assert len(drafters[-1].observed) == len(result.steps) - 1  # told the outcome of every iteration but the last


def test_the_cache_goes_by_the_keyword_the_models_transformers_release_takes():
    """transformers renamed `past_key_values` to `cache`; a release before the rename takes `cache=` into
    **kwargs and decodes without the cache, so SatModel passes the cache by the keyword the class names."""
    from sdsat.sat import cache_keyword

    class Before(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    class After(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return cache

    class Wrapper(torch.nn.Module):  # as peft's model: forward(**kwargs), the model under get_base_model()
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    assert cache_keyword(Before()) == "past_key_values" and cache_keyword(After()) == "cache"
    assert cache_keyword(Wrapper(Before())) == "past_key_values"
    model = make_sat_model("vocab")
    cache = DynamicCache()
    for module in (Before(), After(), Wrapper(Before())):
        model.model = module
        assert model._run(module, torch.tensor([[1, 2]]), None, cache) is cache


def test_vanilla_decodes_a_plain_causal_lm_as_generate_does():
    """decode() takes a plain transformers model for vanilla decoding (no SATs): greedy, as model.generate."""
    model = make_tiny_llama()
    prompt = [5, 17, 3, 59, 42]
    result = collect(decode(model, TOKENIZER, prompt, DecodeConfig(method="vanilla", max_new_tokens=12), []))
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert result.token_ids == expected


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_decoding_path_of_the_sat_hooks_computes_the_training_paths_update(precision):
    """Decoding adds the SAT rows' low-rank update in place, its input cast once per shared layer input and
    the scale folded into B (kept until B changes); training adds it out of place. Same SAT logits, also
    after B is trained in place, and with a float32 adapter on a bfloat16 model (as on a CPU)."""
    sat_model = make_sat_model("adapter")
    sat_model.model.to(getattr(torch, precision))
    sat_model.adapter.to(torch.float32)
    ids, slots = torch.tensor([[5, 7, 9, 1, 1]]), torch.tensor([[-1, -1, -1, 0, 1]])

    def logits(grad: bool):
        with torch.set_grad_enabled(grad):
            return sat_model.forward(ids, slots).detach().float()

    for _ in range(2):
        decoding, training = logits(False), logits(True)
        tolerance = dict(atol=1e-5, rtol=1e-5) if precision == "float32" else dict(atol=0.1, rtol=0.02)
        torch.testing.assert_close(decoding, training, **tolerance)
        assert not torch.equal(decoding[0, 3:], logits(False)[0, 3:] * 0)  # SAT rows are there, not zeros
        with torch.no_grad():  # train B in place: the folded copy must follow
            for b in sat_model.adapter.lora_b.values():
                b.mul_(3.0)
    before = logits(False)
    sat_model.adapter.detach()  # drops the kept copies; attach (to the model's dtype) starts afresh
    assert sat_model.adapter._last_input is None and not sat_model.adapter._scaled_b
    sat_model.adapter.attach(sat_model.model)
    if precision == "float32":
        torch.testing.assert_close(logits(False), before)


def test_the_sat_hooks_are_in_place_only_during_a_pass_with_sat_rows():
    """A module with any hook takes PyTorch's slower call path: plain passes (vanilla's, verify passes) must
    run on the bare model, and a draft pass finds every SAT hook in place, also when another thread's draft pass
    ends first. The layers' hooks run inside their forwards (no registered hook: no slow path for 140 layers);
    only the injection's pre-hook is registered. Afterwards every forward is the module's own again."""
    model = favourite_llama()
    config = AdapterConfig(base_model="tiny", hidden_size=model.config.hidden_size,
                           num_layers=model.config.num_hidden_layers, num_sats=MAX_K, rank=4, inject_layer=1)
    sat_model = SatModel(model, SatSpec(kind="adapter", max_k=MAX_K), SatAdapter.for_model(model, config))
    adapter = sat_model.adapter
    layers = [module for module, _, pre in adapter._hooks if not pre]
    pre_hooks = len(adapter._hooks) - len(layers)
    assert layers and pre_hooks == 1

    def in_place() -> tuple[int, int]:
        """(modules with registered hooks, layers whose forward is wrapped)"""
        registered = sum(bool(m._forward_hooks or m._forward_pre_hooks) for m in sat_model.model.modules())
        return registered, sum("forward" in m.__dict__ for m in layers)

    assert in_place() == (0, 0)
    seen = []
    probe = sat_model.model.lm_head.register_forward_hook(lambda *a: seen.append(in_place()))
    ids, slots = torch.tensor([[5, 7, 9, 1, 1]]), torch.tensor([[-1, -1, -1, 0, 1]])
    with torch.inference_mode():
        sat_model.forward(ids)
        sat_model.forward(ids, slots)
    probe.remove()
    assert seen == [(1, 0), (1 + pre_hooks, len(layers))]  # the probe alone, then the SAT hooks beside it
    assert in_place() == (0, 0)
    with adapter.hooked():
        with adapter.hooked():
            assert in_place() == (pre_hooks, len(layers))
        assert in_place() == (pre_hooks, len(layers))  # the other pass still runs
    assert in_place() == (0, 0)


def test_a_forward_put_in_during_a_pass_with_sat_rows_is_left_alone():
    """The SAT hooks put back only what is still theirs: a forward something else set meanwhile stays."""
    sat_model = make_sat_model("adapter")
    layer = next(module for module, _, pre in sat_model.adapter._hooks if not pre)
    with sat_model.adapter.hooked():
        def replacement(x):
            return x
        layer.forward = replacement
    assert layer.__dict__["forward"] is replacement
    del layer.forward
    with sat_model.adapter.hooked():
        assert "forward" in layer.__dict__
    assert "forward" not in layer.__dict__


def test_routed_layers_call_the_sat_update_after_their_product_and_keep_their_forward():
    """On routed CPU kernels a layer calls its SAT hook itself (cpu_kernels.AFTER), without a forward wrapped
    around it: the same logits as the wrapper gives, bit for bit; afterwards nothing of the pass is left."""
    from sdsat import cpu_kernels

    sat_model = make_sat_model("adapter")
    model = sat_model.model
    if not cpu_kernels.invariant_available():
        pytest.skip("no row-invariant products here (oneDNN's or the compiled kernel)")
    cpu_kernels.install(model, cpu_kernels.invariant_plan(model))
    layers = [module for module, _, pre in sat_model.adapter._hooks if not pre]
    assert layers and all(cpu_kernels.routed(m) for m in layers)
    forwards = {id(m): m.__dict__["forward"] for m in layers}
    seen = []
    probe = model.lm_head.register_forward_hook(
        lambda *a: seen.append([(cpu_kernels.AFTER in m.__dict__, m.__dict__["forward"] is forwards[id(m)])
                                for m in layers]))
    ids, slots = torch.tensor([[5, 7, 9, 1, 1]]), torch.tensor([[-1, -1, -1, 0, 1]])
    with torch.inference_mode():
        after_product = sat_model.forward(ids, slots)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cpu_kernels, "routed", lambda module: False)
            wrapped = sat_model.forward(ids, slots)
        base = model(input_ids=ids[:, :3]).logits
    probe.remove()
    assert seen[0] == [(True, True)] * len(layers)  # called after the product, the routed forward itself
    assert seen[1] == [(False, False)] * len(layers)  # the wrapper's way
    assert torch.equal(after_product, wrapped)
    assert torch.equal(after_product[:, :3], base)  # standard rows: the base model's, bit for bit
    assert all(cpu_kernels.AFTER not in m.__dict__ and m.__dict__["forward"] is forwards[id(m)] for m in layers)


def seven_projection_model(per_position: bool = False, b_scale: float = 0.01) -> SatModel:
    """The favourite Llama with all seven projections adapted (as the shipped adapter is), B random."""
    model = favourite_llama()
    config = AdapterConfig(base_model="tiny", hidden_size=model.config.hidden_size,
                           num_layers=model.config.num_hidden_layers, num_sats=MAX_K, rank=4,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                           per_position=per_position)
    adapter = SatAdapter.for_model(model, config, init_token_id=FAVOURITE)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in adapter.lora_b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * b_scale)
    return SatModel(model, SatSpec(kind="adapter", max_k=MAX_K), adapter)


@pytest.mark.parametrize("per_position", [False, True])
def test_the_decoding_path_of_every_llama_layer_matches_the_training_path(per_position):
    """All seven Llama projections adapted (as the shipped adapter is), shared and per-position updates: SAT
    logits equal the training path's to float32 rounding, also after B is trained in place; standard rows are
    bit-equal to the base model's."""
    sat_model = seven_projection_model(per_position)
    model, adapter = sat_model.model, sat_model.adapter
    ids, slots = torch.tensor([[5, 7, 9, 1, 1, 1]]), torch.tensor([[-1, -1, -1, 0, 1, 2]])
    with torch.inference_mode():
        base = model(input_ids=ids).logits  # a block of the same shape: its first rows are the standard rows'
        decoding = sat_model.forward(ids, slots)
    training = sat_model.forward(ids, slots).detach()
    assert torch.equal(decoding[0, :3], base[0, :3])
    torch.testing.assert_close(decoding, training, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # B trained in place to zero: the kept copies must follow, and the updates must have counted
        for b in adapter.lora_b.values():
            b.zero_()
    with torch.inference_mode():
        embeddings_only = sat_model.forward(ids, slots)
    assert not torch.allclose(decoding[0, 3:], embeddings_only[0, 3:], atol=1e-4)
    torch.testing.assert_close(embeddings_only, sat_model.forward(ids, slots).detach(), atol=1e-5, rtol=1e-5)


def test_prompt_lookup_ungated_verifies_every_copy_it_finds(sat_model: SatModel):
    """`lookup_gate=False` (how the acceptance trace measures copies): copies wherever lookup finds them, each time
    up to lookup_tokens, as before the gate; the output is vanilla's either way."""
    prompt = random_prompts(seed=3, count=1)[0]
    prompt = prompt + prompt[:4]
    budget, lookup, ngram = 24, 4, 1
    reference = collect(decode(sat_model, TOKENIZER, prompt, greedy("vanilla", max_new_tokens=budget), [])).token_ids
    config = replace(greedy("sdsat", 3, budget), lookup_tokens=lookup, lookup_ngram=ngram, lookup_gate=False)
    result = collect(decode(sat_model, TOKENIZER, prompt, config, []))
    assert result.token_ids == reference
    emitted: list[int] = []
    for step in result.steps:
        room = budget - len(emitted) - 1
        before = lookup_continuation(prompt + emitted, ngram, min(lookup, room)) if room > 0 and step.index else []
        after = (lookup_continuation(prompt + emitted + step.tokens[:1], ngram, min(lookup, room - 1))
                 if room > 1 else [])
        if before or after:
            assert (step.draft_source, step.drafts) == ("lookup", before or after)
        else:
            assert step.draft_source == "sat"
        emitted += step.tokens
