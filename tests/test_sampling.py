"""SDSAT sampling is lossless: its output has exactly the distribution of vanilla sampling.

On a tiny vocabulary the joint distribution of the first three new tokens can be computed exactly
from the model's probabilities (with transformers' own temperature / top-k / top-p warpers). Seeded
samples of SDSAT and of vanilla sampling are compared with it, and with each other, by chi-square
tests. The SAT adapter drafts from distributions q far enough from the model's p that drafts are
both accepted and rejected, so a wrong residual (resampling from p instead of max(0, p - q))
shifts the distribution by far more than these tests tolerate.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from conftest import make_tiny_llama
from sdsat.decoding import DecodeConfig, decode, collect
from sdsat.records import AcceptTest
from sdsat.sampling import NUCLEUS_CANDIDATES, PartialSortTopP, SamplingConfig, TokenChooser, inverse_cdf
from sdsat.sat import AdapterConfig, SatAdapter, SatModel, SatSpec

VOCAB = 8
NEW_TOKENS = 3
PROMPT = [2, 5, 3]
SAMPLES = 1200  # per setting; a wrong residual gives p-values below 1e-9 at this size
ALPHA = 1e-3  # the samples are seeded, so each test is deterministic; this is its false-alarm rate

SETTINGS = {
    # name: (k, sampling settings, scheme, lookup_tokens); k = 1 reaches the bonus token within three
    # tokens, k = 2 a second draft; the fused scheme draws its later drafts from SAT runs in the verify
    # pass; with prompt lookup the tokens after the first iteration are often copies (q one-hot)
    "t0.7-k1": (1, dict(temperature=0.7), "two_step", 0),
    "t1.3-topp0.9-topk5-k2": (2, dict(temperature=1.3, top_p=0.9, top_k=5), "two_step", 0),
    "fused-t1.3-topp0.9-topk5-k1": (1, dict(temperature=1.3, top_p=0.9, top_k=5), "fused", 0),
    "lookup-t1.3-topk5-k1": (1, dict(temperature=1.3, top_k=5), "two_step", 2),
}


class SilentTokenizer:
    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def sat_model() -> SatModel:
    model = make_tiny_llama(vocab_size=VOCAB, layers=1, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # from near-uniform to a few likely tokens per position
    config = AdapterConfig(base_model="tiny", hidden_size=model.config.hidden_size, num_layers=1, num_sats=4, rank=4)
    adapter = SatAdapter.for_model(model, config, init_token_id=3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # drafts that are often, but far from always, what the model would sample
        adapter.embeddings.add_(torch.randn(adapter.embeddings.shape, generator=gen) * 0.02)
        for b in adapter.lora_b.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
    return SatModel(model, SatSpec(kind="adapter", max_k=4), adapter)


def warpers(settings: dict) -> LogitsProcessorList:
    out = LogitsProcessorList([TemperatureLogitsWarper(settings["temperature"])])
    if settings.get("top_k"):
        out.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p", 1.0) < 1.0:
        out.append(TopPLogitsWarper(settings["top_p"]))
    return out


def exact_joint(model, settings: dict) -> np.ndarray:
    """P(x1, x2, x3) of vanilla sampling, shape (V, V, V), from one batched forward pass."""
    n, v = len(PROMPT), VOCAB
    x1, x2 = torch.meshgrid(torch.arange(v), torch.arange(v), indexing="ij")
    seqs = torch.cat([torch.tensor(PROMPT).expand(v * v, n), x1.reshape(-1, 1), x2.reshape(-1, 1)], 1)  # (V*V, n+2)
    with torch.inference_mode():
        logits = model(input_ids=seqs).logits.float()  # (V*V, n+2, V)
    warp = warpers(settings)

    def probs(rows: torch.Tensor) -> torch.Tensor:
        return torch.softmax(warp(None, rows), -1)

    p1 = probs(logits[:1, n - 1])[0]  # (V,): after the prompt
    p2 = probs(logits[::v, n])  # (V, V): row x1
    p3 = probs(logits[:, n + 1]).reshape(v, v, v)  # (V, V, V): row (x1, x2)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.double().numpy()


def draw(sat_model: SatModel, method: str, k: int, settings: dict, seeds: range,
         scheme: str = "two_step", lookup_tokens: int = 0) -> tuple[Counter, Counter]:
    """Counts of the first NEW_TOKENS tokens over seeded runs, and counts of verification outcomes."""
    samples, sources = Counter(), Counter()
    for seed in seeds:
        # Lookup: a repeated single token is enough (lookup_ngram 1), and one token more is decoded,
        # because copies are only drafted while two or more tokens remain; the first three are counted.
        extra = 1 if lookup_tokens else 0
        config = DecodeConfig(method=method, k=k, max_new_tokens=NEW_TOKENS + extra, scheme=scheme,
                              lookup_tokens=lookup_tokens, lookup_ngram=1,
                              sampling=SamplingConfig(do_sample=True, seed=seed, **settings))
        result = collect(decode(sat_model, SilentTokenizer(), PROMPT, config, eos_ids=[]))
        assert len(result.token_ids) == NEW_TOKENS + extra
        samples[tuple(result.token_ids[:NEW_TOKENS])] += 1
        emitted = 0
        for step in result.steps:
            sources["accepted"] += step.accepted
            sources["rejection"] += step.accepted < step.k
            sources["bonus"] += step.accepted == step.k
            sources["lookup"] += step.draft_source == "lookup" and emitted < NEW_TOKENS  # copies within the three
            emitted += len(step.tokens)
    return samples, sources


def goodness_of_fit(samples: Counter, joint: np.ndarray) -> float:
    """Chi-square p-value of the samples against the exact distribution; rare cells are pooled."""
    total = sum(samples.values())
    expected = joint.reshape(-1) * total
    observed = np.zeros_like(expected)
    for tokens, count in samples.items():
        observed[np.ravel_multi_index(tokens, joint.shape)] = count
    assert observed[expected == 0].sum() == 0, "sampled a sequence the warpers rule out"
    expected, observed = expected[expected > 0], observed[expected > 0]
    rare = expected < 5
    obs, exp = observed[~rare], expected[~rare]
    if rare.any():  # no empty pooled cell: its 0/0 term would make the p-value NaN, which `min` then skips
        obs, exp = np.append(obs, observed[rare].sum()), np.append(exp, expected[rare].sum())
    exp *= obs.sum() / exp.sum()  # exact up to float rounding
    return stats.chisquare(obs, exp).pvalue


def homogeneity(a: Counter, b: Counter) -> float:
    """Chi-square p-value that two sample sets share one distribution; rare outcomes are pooled."""
    keys = sorted(set(a) | set(b))
    table = np.array([[a[key] for key in keys], [b[key] for key in keys]], dtype=float)
    rare = table.sum(0) < 10
    table = np.column_stack([table[:, ~rare], table[:, rare].sum(1)])
    return stats.chi2_contingency(table[:, table.sum(0) > 0]).pvalue


@pytest.mark.parametrize("name", SETTINGS)
def test_sdsat_sampling_matches_vanilla_and_the_exact_distribution(sat_model: SatModel, name: str):
    k, settings, scheme, lookup_tokens = SETTINGS[name]
    joint = exact_joint(sat_model.model, settings)
    sdsat, sources = draw(sat_model, "sdsat", k, settings, range(SAMPLES), scheme, lookup_tokens)
    vanilla, _ = draw(sat_model, "vanilla", k, settings, range(SAMPLES, SAMPLES + SAMPLES // 2))
    # Both verification outcomes really happened, often: otherwise this would test plain sampling.
    assert sources["accepted"] > SAMPLES // 5 and sources["rejection"] > SAMPLES // 5, sources
    assert sources["bonus"] > SAMPLES // 10, sources  # every draft accepted: the bonus comes from p
    assert (sources["lookup"] > SAMPLES // 10) == bool(lookup_tokens), sources  # copies were verified
    assert goodness_of_fit(sdsat, joint) > ALPHA
    assert goodness_of_fit(vanilla, joint) > ALPHA
    assert homogeneity(sdsat, vanilla) > ALPHA


def test_accept_keeps_the_first_token_distributed_as_p():
    """The verification step alone, on fixed p and q: the token after t follows p exactly."""
    gen = torch.Generator().manual_seed(0)
    k, v, draws = 2, 6, 20000
    logits = torch.randn(k + 1, v, generator=gen) * 2
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits[:k] + torch.randn(k, v, generator=gen) * 2, -1)  # related to p, not equal
    chooser = TokenChooser(SamplingConfig(do_sample=True, seed=0), torch.device("cpu"))
    drafts = torch.multinomial(q, draws, replacement=True, generator=gen).T  # (draws, k), row i from q
    counts = np.zeros(v)
    accepted = 0
    for row in drafts:
        n, next_token, _ = chooser.accept(p, q, row)
        counts[int(row[0]) if n > 0 else next_token] += 1
        accepted += n > 0
    assert 0.2 < accepted / draws < 0.8
    expected = p[0].double().numpy()
    assert stats.chisquare(counts, expected / expected.sum() * draws).pvalue > ALPHA


@pytest.mark.parametrize("top_k", [0, 50])
def test_the_partial_sort_nucleus_keeps_what_transformers_top_p_keeps(top_k: int):
    """PartialSortTopP against transformers' TopPLogitsWarper on a real vocabulary's width: peaked rows, whose
    nucleus lies within the candidates, and flat ones, whose nucleus is wider and goes to the whole-row sort.
    In float32 the kept tokens are the same; with bfloat16's ties at the edge of the nucleus, which of the
    tied tokens stays is the sort's arbitrary choice, so only how many stay is compared there."""
    gen = torch.Generator().manual_seed(0)
    vocabulary = 49152
    scales = torch.tensor([0.3, 1.0, 3.0, 8.0, 20.0])[:, None]  # flat (wide nucleus) to peaked (a few tokens)
    scores = torch.randn(len(scales), vocabulary, generator=gen) * scales
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    tied = scores.bfloat16().float() / 0.7
    for top_p in (0.1, 0.5, 0.9, 0.95, 0.999):
        ours = PartialSortTopP(top_p)(None, scores.clone())
        theirs = TopPLogitsWarper(top_p)(None, scores.clone())
        assert torch.equal(ours, theirs), top_p
        kept = [(warper(None, tied.clone()) > float("-inf")).sum(-1) for warper in (PartialSortTopP(top_p),
                                                                                    TopPLogitsWarper(top_p))]
        assert torch.equal(*kept), top_p
    sizes = (TopPLogitsWarper(0.95)(None, scores.clone()) > float("-inf")).sum(-1)
    if not top_k:  # both kinds of row were there
        assert sizes.min() <= NUCLEUS_CANDIDATES < sizes.max()


def test_inverse_cdf_lands_on_tokens_with_mass_at_both_ends_of_the_unit_interval():
    rows = torch.tensor([[0.0, 0.0, 2.0, 0.0, 6.0, 0.0],  # not normalised; zeros at both ends and between
                         [0.0, 0.25, 0.25, 0.5, 0.0, 0.0]])
    below_one = torch.tensor(np.nextafter(1.0, 0.0), dtype=torch.float64)
    assert inverse_cdf(rows, torch.zeros(2, dtype=torch.float64)).tolist() == [2, 1]
    assert inverse_cdf(rows, below_one.expand(2)).tolist() == [4, 3]
    assert inverse_cdf(rows, torch.tensor([0.25, 0.5], dtype=torch.float64)).tolist() == [4, 3]
    assert inverse_cdf(rows, torch.tensor([0.2499, 0.4999], dtype=torch.float64)).tolist() == [2, 2]
    for bad in ([0.0, 0.0], [float("nan"), 1.0], [-0.5, 1.5]):
        with pytest.raises(ValueError, match="cannot draw"):
            inverse_cdf(torch.tensor([bad]), torch.zeros(1, dtype=torch.float64))


def test_a_drawn_token_follows_its_row_and_never_lands_where_there_is_no_mass():
    chooser = TokenChooser(SamplingConfig(do_sample=True, seed=0), torch.device("cpu"))
    p = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 0.5]])
    draws = 20000
    tokens = torch.stack([chooser.draw(p) for _ in range(draws)])  # (draws, 2)
    for row in range(len(p)):
        counts = np.bincount(tokens[:, row].numpy(), minlength=p.shape[1])
        assert counts[p[row].numpy() == 0].sum() == 0
        support = p[row].numpy() > 0
        assert stats.chisquare(counts[support], p[row].numpy()[support] * draws).pvalue > ALPHA


def test_siblings_are_successive_draws_without_replacement_on_a_wide_vocabulary():
    """The first and second of three siblings against their exact marginals, P(x2 = x) = sum over y != x of
    q(y) q(x) / (1 - q(y)), on a row shaped like a real one: a few likely tokens, a long thin tail."""
    vocabulary, draws = 5000, 6000
    q = torch.full((vocabulary,), 0.2 / (vocabulary - 3), dtype=torch.float64)
    q[[7, 1234, 4999]] = torch.tensor([0.5, 0.2, 0.1], dtype=torch.float64)
    q[[0, 10]] = 0.0
    q /= q.sum()
    chooser = TokenChooser(SamplingConfig(do_sample=True, seed=0), torch.device("cpu"))
    drawn, valid = zip(*(chooser.draw_ranked(q[None].float(), 3) for _ in range(draws)))
    drawn = torch.cat(drawn)  # (draws, 3)
    assert all(v == [3] for v in valid)
    assert all(len(set(row)) == 3 for row in drawn.tolist())
    second = (q[:, None] * q[None, :] / (1 - q[:, None])).sum(0) - q * q / (1 - q)  # sum over y != x
    for i, marginal in enumerate((q, second)):
        counts = np.bincount(drawn[:, i].numpy(), minlength=vocabulary).astype(float)
        expected = marginal.numpy() * draws
        assert counts[expected == 0].sum() == 0
        rare = expected < 5
        obs = np.append(counts[~rare], counts[rare].sum())
        exp = np.append(expected[~rare], expected[rare].sum())
        assert stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA


# Draft trees under sampling: (k, tree_candidates, sampling settings, lookup_tokens). With k = 1 the
# root's children are 2 or 4 draws of SAT 1 (siblings); k = 2 with 5 runner-ups gives 4 siblings at the
# root and 2 below the first; top-k 5 (or top-p) leaves q fewer tokens than draws at some positions.
TREES = {
    "chain-t1-k3": (3, 0, dict(temperature=1.0), 0),
    "siblings2-t1-topp0.9": (1, 1, dict(temperature=1.0, top_p=0.9), 0),
    "siblings4-t0.5-topk6": (1, 3, dict(temperature=0.5, top_k=6), 0),
    "siblings4x2-t1.5-topp0.9-topk5": (2, 5, dict(temperature=1.5, top_p=0.9, top_k=5), 0),
    "lookup-siblings2-t1-k2": (2, 2, dict(temperature=1.0), 2),
    "short-siblings4-t0.5-topp0.6": (1, 3, dict(temperature=0.5, top_p=0.6), 0),  # q often has < 4 tokens
}
TREE_TOKENS = 4


def exact_marginals(model, settings: dict, positions: int, prompt: list[int] = PROMPT) -> list[np.ndarray]:
    """P(x_i) of vanilla sampling for each of the first `positions` new tokens after `prompt`, exactly: every
    sequence of the first positions - 1 tokens is fed in one batch, and the chain rule sums over them."""
    n, v = len(prompt), VOCAB
    prefixes = torch.cartesian_prod(*[torch.arange(v)] * (positions - 1)).reshape(-1, positions - 1)
    seqs = torch.cat([torch.tensor(prompt).expand(len(prefixes), n), prefixes], 1)
    with torch.inference_mode():
        logits = model(input_ids=seqs).logits.float()
    warp = warpers(settings)
    probs = torch.softmax(warp(None, logits.reshape(-1, v)), -1).reshape(len(prefixes), -1, v).double()
    weight = torch.ones(len(prefixes), dtype=torch.float64)  # P(prefix up to position i), per row
    marginals = []
    for i in range(positions):
        step = probs[:, n - 1 + i]  # (rows, V): p(x_{i+1} | prompt, prefix[:i])
        # rows sharing a prefix of length i give the same p; count each such prefix once
        once = weight / v ** (positions - 1 - i)
        marginals.append((once[:, None] * step).sum(0).numpy())
        if i < positions - 1:
            weight = weight * step[torch.arange(len(prefixes)), prefixes[:, i]]
    return marginals


def draw_tree(sat_model: SatModel, k: int, extra: int, settings: dict, seeds: range,
              lookup_tokens: int = 0) -> tuple[list[Counter], Counter, Counter]:
    """Per position, counts of the first TREE_TOKENS tokens of seeded SDSAT runs (and under "pairs", of the
    first two together); counts of verification outcomes; and how many siblings were tried at a position (how
    often a later sibling was reached)."""
    per_position, outcomes, siblings = [Counter() for _ in range(TREE_TOKENS)], Counter(), Counter()
    pairs = Counter()
    for seed in seeds:
        config = DecodeConfig(method="sdsat", k=k, max_new_tokens=TREE_TOKENS + 1, tree_candidates=extra,
                              lookup_tokens=lookup_tokens, lookup_ngram=1,
                              sampling=SamplingConfig(do_sample=True, seed=seed, **settings))
        result = collect(decode(sat_model, SilentTokenizer(), PROMPT, config, eos_ids=[]))
        for i, token in enumerate(result.token_ids[:TREE_TOKENS]):
            per_position[i][token] += 1
        pairs[tuple(result.token_ids[:2])] += 1
        for step in result.steps:
            outcomes["accepted"] += step.accepted
            outcomes["lookup"] += step.draft_source == "lookup"
            tried = Counter(test.depth for test in step.accept_tests)
            siblings.update(tried.values())
            outcomes["rejection"] += any(test.replacement is not None for test in step.accept_tests)
    return per_position + [pairs], outcomes, siblings


def marginal_fit(counts: Counter, marginal: np.ndarray) -> float:
    """Chi-square p-value of one position's token counts against its exact marginal; rare tokens pooled."""
    total = sum(counts.values())
    observed = np.array([counts[t] for t in range(len(marginal))], dtype=float)
    expected = marginal * total
    assert observed[expected == 0].sum() == 0, "sampled a token the warpers rule out"
    observed, expected = observed[expected > 0], expected[expected > 0]
    rare = expected < 5
    obs, exp = observed[~rare], expected[~rare]
    if rare.any():
        obs, exp = np.append(obs, observed[rare].sum()), np.append(exp, expected[rare].sum())
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def tree_p_values(sat_model: SatModel, name: str) -> tuple[list[float], Counter, Counter]:
    """Chi-square p-values of the first TREE_TOKENS positions, one by one, then of the first two together."""
    k, extra, settings, lookup_tokens = TREES[name]
    marginals = exact_marginals(sat_model.model, settings, TREE_TOKENS)
    counts, outcomes, siblings = draw_tree(sat_model, k, extra, settings, range(SAMPLES), lookup_tokens)
    pair = exact_joint(sat_model.model, settings).sum(2)  # P(x1, x2)
    return ([marginal_fit(c, m) for c, m in zip(counts, marginals)] + [goodness_of_fit(counts[-1], pair)],
            outcomes, siblings)


@pytest.mark.parametrize("name", TREES)
def test_tree_sampling_gives_every_position_the_distribution_of_vanilla_sampling(sat_model: SatModel, name: str,
                                                                                 monkeypatch):
    """Multi-draft rejection sampling over a draft tree: each of the first four tokens, and the first two
    together, follow vanilla sampling's exact distribution, with siblings really tried (a later sibling is
    often reached), also where top-p leaves q fewer tokens than the tree has siblings."""
    k, extra, _, lookup_tokens = TREES[name]
    draw_ranked, short = TokenChooser.draw_ranked, []

    def counting(self, q, count):
        draws, valid = draw_ranked(self, q, count)
        short.extend(n < count for n in valid)
        return draws, valid

    monkeypatch.setattr(TokenChooser, "draw_ranked", counting)
    p_values, outcomes, siblings = tree_p_values(sat_model, name)
    if name.startswith("short"):
        assert sum(short) > SAMPLES // 10, sum(short)
    assert outcomes["accepted"] > SAMPLES // 5 and outcomes["rejection"] > SAMPLES // 5, outcomes
    if extra:
        assert sum(n for tried, n in siblings.items() if tried > 1) > SAMPLES // 10, siblings
    if extra >= 3 and k == 1 and not name.startswith("short"):
        assert siblings[4] > SAMPLES // 50, siblings  # all four siblings tried at one position
    assert (outcomes["lookup"] > SAMPLES // 10) == bool(lookup_tokens), outcomes
    assert min(p_values) > ALPHA, p_values


@pytest.mark.parametrize("bias", ["first sibling accepted untested", "later siblings tested against q"])
def test_a_biased_tree_sampler_fails_the_same_test(sat_model: SatModel, monkeypatch, bias: str):
    """The test has power: accepting the first sibling without its test, or testing later siblings against q
    instead of q less the earlier draws, each shift some position far beyond the test's tolerance."""
    honest = TokenChooser.try_siblings

    def biased(self, p, q, draws, ranks, depth):
        if bias.startswith("first"):
            return 0, None, [AcceptTest(depth=depth, token=draws[ranks[0]], p=1.0, q=1.0, u=0.0, accepted=True)]
        # q never loses the earlier draws: pretend each sibling was drawn first
        residual, tests = p, []
        for i, rank in enumerate(ranks):
            taken, token, tried = honest(self, residual, q, [draws[rank]], [0], depth)
            tests += tried
            if taken is not None:
                return i, None, tests
            left = (residual - q).clamp(min=0)
            residual = left / left.sum() if left.sum() > 0 else residual
        return None, token, tests

    monkeypatch.setattr(TokenChooser, "try_siblings", biased)
    try:
        p_values, _, _ = tree_p_values(sat_model, "siblings4-t0.5-topk6")
    except AssertionError as err:  # it emitted a token or pair that vanilla sampling can never give
        assert "rule out" in str(err)
    else:
        assert min(p_values) < ALPHA, p_values


def test_sibling_tests_give_p_when_q_has_few_tokens_or_rounds_to_zero():
    """The accept tests alone, on fixed p and q: q's support holds 2 tokens (plus one whose probability is a
    float32 denormal) and the tree 4 siblings; the token each round of tries gives follows p, and no draft
    q gives no mass is ever accepted."""
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
    q = torch.tensor([0.9999, 1e-4, 1.4e-45, 0.0, 0.0])  # draws without replacement can tie 1.4e-45 with 0
    chooser = TokenChooser(SamplingConfig(do_sample=True, seed=0), torch.device("cpu"))
    counts, rounds = np.zeros(5), 20000
    for _ in range(rounds):
        draws, valid = chooser.draw_ranked(q[None], 4)
        taken, token, tests = chooser.try_siblings(p, q, draws[0].tolist(), list(range(valid[0])), depth=1)
        assert all(test.q > 0 for test in tests)
        counts[int(draws[0, taken]) if taken is not None else token] += 1
    expected = p.double().numpy()
    assert stats.chisquare(counts, expected / expected.sum() * rounds).pvalue > ALPHA


def test_a_seed_gives_the_same_sampled_output_twice_with_and_without_a_tree(sat_model: SatModel):
    outputs = {}
    for extra in (0, 3):
        for run in range(2):
            config = DecodeConfig(method="sdsat", k=2, max_new_tokens=12, tree_candidates=extra,
                                  sampling=SamplingConfig(do_sample=True, temperature=1.0, seed=7))
            outputs[extra, run] = collect(decode(sat_model, SilentTokenizer(), PROMPT, config, eos_ids=[])).token_ids
    assert outputs[0, 0] == outputs[0, 1] and outputs[3, 0] == outputs[3, 1]


REAL_PROMPT = "def add(a, b):\n"
REAL_SETTINGS = dict(temperature=1.0, top_k=4)  # a slice of the real vocabulary: the position's top 4


def test_multi_draft_sampling_on_the_real_models_distributions_gives_p(default_engine, monkeypatch):
    """The embedded model and its shipped SATs over a slice of the real vocabulary (top-k 4): SAT 1's q from
    a real draft pass, the model's p after t, four siblings drawn from q without replacement and tried in
    order, many times. The token each try gives (an accepted draw, or the last residual's) follows p."""
    from transformers import DynamicCache

    from sdsat.drafters import DraftContext, draft_pass
    from sdsat.timing import Clock

    sat_model, ids = default_engine.sat_model, default_engine.encode(REAL_PROMPT)
    # The SATs' own q: the shipped sampler head's, conditioned on t, is so close to p here that later siblings are
    # never reached (its sampling is covered by test_head.py's chi-square tests).
    monkeypatch.setattr(sat_model, "sampler", None)
    chooser = TokenChooser(SamplingConfig(do_sample=True, seed=0, **REAL_SETTINGS), sat_model.device)
    cache = DynamicCache(config=sat_model.model.config)
    with torch.inference_mode():
        t, _, q, _ = draft_pass(DraftContext(sat_model, chooser, cache, list(ids), list(ids), 8,
                                             Clock(sat_model.device)), 1)
        p = chooser.probs(sat_model.forward(torch.tensor([[t]], device=sat_model.device), cache=cache,
                                            logits_to_keep=1)[0])[0]
        counts, later, rejected = Counter(), 0, 0
        for _ in range(SAMPLES * 6):
            draws, valid = chooser.draw_ranked(q, 4)
            taken, token, tests = chooser.try_siblings(p, q[0], draws[0].tolist(), list(range(valid[0])), depth=1)
            counts[int(draws[0, taken]) if taken is not None else token] += 1
            later += taken is not None and taken > 0
            rejected += taken is None
    # Later siblings and residual draws both happened, often enough for the fit to see them (a better adapter's
    # first sibling passes more often: the stage-3 adapter leaves about 60 later-sibling tokens in 3,600)
    assert later > SAMPLES // 20 and rejected > SAMPLES // 20
    assert set(counts) <= set(p.nonzero().flatten().tolist())
    marginal = np.zeros(p.shape[-1])
    marginal[p.nonzero().flatten().numpy()] = p[p > 0].double().numpy()
    assert marginal_fit(counts, marginal) > ALPHA
