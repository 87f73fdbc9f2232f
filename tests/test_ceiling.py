"""The bound on a sampled draft that cannot see the pass's own token (`python -m sdsat.bench.ceiling`)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache

from sdsat.bench.ceiling import (best_rate, blind_rates, candidate_distributions, candidates_of, measure_prompt,
                                 sat_draft)
from sdsat.drafters import DraftContext, draft_pass
from sdsat.sampling import SamplingConfig, TokenChooser
from sdsat.sat import AdapterConfig, SatAdapter, SatModel, SatSpec
from sdsat.timing import Clock


def sampler(temperature: float, seed: int = 0) -> TokenChooser:
    return TokenChooser(SamplingConfig(do_sample=True, temperature=temperature, seed=seed), torch.device("cpu"))


def test_candidates_continue_as_if_each_were_decoded_alone():
    model = make_tiny_llama(seed=3)
    sat_model, chooser, prompt = SatModel(model, SatSpec(kind="vocab", sat_ids=[2])), sampler(1.0), [0, 5, 9, 12, 4]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        sat_model.forward(torch.tensor([prompt]), cache=cache)
        together = candidate_distributions(sat_model, chooser, cache, torch.tensor([7, 3, 30]))
        assert cache.get_seq_length() == len(prompt)  # the candidates left the cache
        for row, candidate in zip(together, (7, 3, 30)):
            alone = chooser.probs(sat_model.forward(torch.tensor([prompt + [candidate]]))[0, -1:])[0]
            torch.testing.assert_close(row, alone, atol=1e-6, rtol=1e-5)


def test_the_rates_of_drafts_blind_to_the_token_before_them():
    # Two equally likely tokens t, each followed by a certain, different token: a draft that cannot see t
    # passes at most half the time however it is chosen; one that guesses the likelier t, as greedy text
    # teaches, passes whenever t is that one.
    after = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    rates = blind_rates(after, torch.tensor([0.6, 0.4]), {"second": torch.tensor([0.0, 1.0, 0.0])})
    assert rates == pytest.approx({"best": 0.6, "marginal": 0.6 * 0.6 + 0.4 * 0.4, "greedy": 0.6, "second": 0.4})
    # A certain t: the bound is 1.
    assert blind_rates(after[:1], torch.tensor([1.0]), {}) == pytest.approx(
        {"best": 1.0, "marginal": 1.0, "greedy": 1.0})
    # Neither the marginal nor the likeliest t's continuation is the best: here two less likely t agree.
    after = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    rates = blind_rates(after, torch.tensor([0.4, 0.3, 0.3]), {})
    assert rates == pytest.approx({"best": 0.6, "marginal": 0.4 * 0.4 + 0.6 * 0.6, "greedy": 0.4})


@pytest.mark.parametrize("seed", range(6))
def test_the_best_rate_is_the_optimum_of_its_linear_program(seed):
    from scipy.optimize import linprog

    gen = torch.Generator().manual_seed(seed)
    candidates, vocab = 4, 7
    after = torch.softmax(torch.randn(candidates, vocab, generator=gen) * 3, -1).double()
    weights = torch.softmax(torch.randn(candidates, generator=gen), -1).double()
    # Variables: q (V), then m[c, x] <= min(after[c, x], q[x]); maximise sum_c w_c sum_x m[c, x].
    cost = torch.cat([torch.zeros(vocab), -weights.repeat_interleave(vocab)]).numpy()
    rows, bounds_m = [], []
    for c in range(candidates):
        for x in range(vocab):
            row = torch.zeros(vocab + candidates * vocab)
            row[c * vocab + vocab + x], row[x] = 1, -1  # m[c, x] - q[x] <= 0
            rows.append(row)
            bounds_m.append((0, float(after[c, x])))
    total = torch.cat([torch.ones(vocab), torch.zeros(candidates * vocab)])[None].numpy()
    result = linprog(cost, A_ub=torch.stack(rows).numpy(), b_ub=torch.zeros(len(rows)).numpy(), A_eq=total,
                     b_eq=[1.0], bounds=[(0, 1)] * vocab + bounds_m)
    assert result.status == 0
    best = best_rate(after.float(), weights.float())
    assert best == pytest.approx(-result.fun, abs=1e-5)
    rates = blind_rates(after.float(), weights.float(), {})
    assert best >= max(rates["marginal"], rates["greedy"]) - 1e-6


def test_the_best_rate_when_the_candidates_leave_less_than_a_unit_to_fill():
    # Every candidate is followed by token 0 for sure: the pieces total 1 exactly, and q = e0 passes always.
    assert best_rate(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0.5, 0.5])) == pytest.approx(1.0)
    # Sub-normalised rows (mass cut off) leave less than a unit of pieces: the rest of q is worth nothing.
    after, weights = torch.tensor([[0.3, 0.0], [0.0, 0.2]]), torch.tensor([0.5, 0.5])
    assert best_rate(after, weights) == pytest.approx(0.5 * 0.3 + 0.5 * 0.2)


def test_the_sat_draft_is_the_decoders_own():
    model = make_tiny_llama(seed=4)
    config = AdapterConfig(base_model="tiny", hidden_size=32, num_layers=2, num_sats=2, rank=2)
    adapter = SatAdapter.for_model(model, config, 4)
    with torch.no_grad():
        for b in adapter.lora_b.values():
            b.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    sat_model, chooser = SatModel(model, SatSpec(kind="adapter", max_k=2), adapter), sampler(0.8)
    prompt = [0, 5, 9, 12, 4]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        sat_model.forward(torch.tensor([prompt[:-1]]), cache=cache)
        ours = sat_draft(sat_model, chooser, cache, prompt[-1])
        assert cache.get_seq_length() == len(prompt) - 1  # the draft pass left nothing behind
        context = DraftContext(sat_model, chooser, cache, [prompt[-1]], prompt, room=8, clock=Clock(sat_model.device))
        _, _, q, _ = draft_pass(context, 1)
    torch.testing.assert_close(ours, q[0])
    assert not torch.allclose(ours, chooser.probs(sat_model.forward(torch.tensor([prompt]))[0, -1:])[0])


def test_candidates_cover_the_mass_asked_for_without_the_excluded():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens, weights, covered = candidates_of(p, 0.75, 8, exclude=[])
    assert tokens.tolist() == [0, 1] and covered == pytest.approx(0.8)
    torch.testing.assert_close(weights, torch.tensor([0.625, 0.375]))
    tokens, _, covered = candidates_of(p, 0.99, 2, exclude=[0])
    assert tokens.tolist() == [1, 2] and covered == pytest.approx(0.45)  # at most 2


def test_along_a_decode_the_bounds_are_rates_and_near_one_when_t_is_nearly_certain():
    model = make_tiny_llama(seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # decisive logits: at a low temperature every next token is all but certain
    base = SatModel(model, SatSpec(kind="vocab", sat_ids=[2]))
    config = AdapterConfig(base_model="tiny", hidden_size=32, num_layers=2, num_sats=1, rank=2)
    adapters = {"sats": SatModel(model, SatSpec(kind="adapter", max_k=1), SatAdapter.for_model(model, config, 4))}
    prompt = [0, 5, 9, 12, 4]
    warm = measure_prompt(base, adapters, sampler(1.0), prompt, 12, eos_ids=[1], mass=0.99, most=16)
    cold = measure_prompt(base, adapters, sampler(0.02), prompt, 12, eos_ids=[1], mass=0.99, most=16)
    assert 0 < len(warm) <= 11 and len(cold) == 11  # a rate wherever the token after t is still output
    for row in warm + cold:
        assert all(0 <= row[c] <= 1 + 1e-6 for c in ("best", "marginal", "greedy", "sats")) and 0 < row["covered"] <= 1
        assert row["best"] >= max(row["marginal"], row["greedy"], row["sats"]) - 1e-5
    # Near T 0 the pass's own token is all but certain, and so is the token after it: the bound is 1.
    assert min(r["marginal"] for r in cold) > 0.99 and min(r["greedy"] for r in cold) > 0.99
    assert min(r["best"] for r in cold) > 0.99
