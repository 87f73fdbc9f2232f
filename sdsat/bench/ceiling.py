"""`python -m sdsat.bench.ceiling`: how often could the best SAT draft pass its accept test when sampling?

A draft pass feeds the last token of the history h and gives two things at once: the distribution p(t | h)
of the pass's own token t, and SAT 1's draft for the token after t. SAT 1 cannot see t: it is drawn from
the very pass that computes SAT 1. Under greedy decoding t is the argmax, so SAT 1 may as well have seen it.
Under sampling, the accept test of SAT 1's draft, with q its (warped) distribution, passes with probability

    a(q) = sum_t p(t | h) sum_x min(p(x | h, t), q(x))

and no q that depends on h alone can make this 1 while t is uncertain. Along vanilla's sampled output,
at every position this tool computes exactly, over the candidates t that cover `--mass` of p(t | h):

- `best`: the largest a(q) of any q (`best_rate`), the most a SAT 1 that cannot see t could pass;
- `marginal`: a(q) for q = sum_t p(t | h) p(x | h, t), the distribution of the token after t given h
  alone: what a SAT trained to convergence on the model's own sampled text predicts;
- `greedy`: a(q) for q = p(x | h, argmax t): what a SAT trained to convergence on greedy text predicts;
- for each adapter given, a(q) with q its SAT 1: what `python -m sdsat.bench.drafts` reports as SAT 1's pass
  rate, there along the t that was drawn and over the positions with k drafts left, here averaged over t.

The candidate continuations run as one block over the KV cache, each candidate seeing the history and
itself (`candidate_distributions`). The gap between an adapter and `best` is what training could still
win; the gap between `best` and 1 belongs to drafts that do not see t, at any scale of data.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def candidate_distributions(sat_model, chooser, cache, candidates: torch.Tensor) -> torch.Tensor:
    """(C,) candidate next tokens -> (C, V) the warped distribution of the token after each, given the cached
    history: one pass in which each candidate sees the cache and itself, all at the same position. The
    cache is left as it was."""
    from ..kvcache import behind_cache, rollback

    base, count, device = cache.get_seq_length(), len(candidates), sat_model.device
    mask = behind_cache(torch.eye(count, dtype=torch.bool)[None, None], base, device)
    logits = sat_model.forward(candidates[None].to(device), cache=cache, attention_mask=mask,
                               position_ids=torch.full((1, count), base, device=device))[0]
    rollback(cache, base)
    return chooser.probs(logits)


def blind_rates(after: torch.Tensor, weights: torch.Tensor,
                sat_q: dict[str, torch.Tensor]) -> dict[str, float]:
    """a(q) at its maximum over q ("best"), and at the marginal, the greedy and each SAT's q, from the
    candidates' weights (C,) (summing to 1) and the distributions after each candidate (C, V), the candidates
    in descending p(t | h)."""
    marginal = weights @ after
    greedy = after[0]  # the likeliest candidate (EOS is never one)

    def rate(q: torch.Tensor) -> float:
        return float(weights @ torch.minimum(after, q[None]).sum(-1))

    return ({"best": best_rate(after, weights), "marginal": rate(marginal), "greedy": rate(greedy)}
            | {name: rate(q) for name, q in sat_q.items()})


def best_rate(after: torch.Tensor, weights: torch.Tensor) -> float:
    """max over distributions q of a(q) = sum_x sum_c w_c min(after[c, x], q(x)).

    Each token's term is concave and piecewise linear in q(x): between the c-th and (c+1)-th smallest of
    after[:, x] its slope is the weight of the candidates above. So the best q fills its unit of mass into
    these pieces, steepest first, over all tokens (those no candidate can follow with have no pieces).
    """
    tokens = (after.max(0).values > 0).nonzero().squeeze(-1)
    values, order = after[:, tokens].double().sort(0)  # (C, K) ascending per token
    slopes = weights.double()[order].flip(0).cumsum(0).flip(0)  # weight of the candidates at or above each piece
    lengths = values - torch.cat([torch.zeros_like(values[:1]), values[:-1]])
    slopes, by_slope = slopes.flatten().sort(descending=True)
    lengths = lengths.flatten()[by_slope]
    filled = lengths.cumsum(0)
    full = int((filled < 1).sum())  # pieces filled whole (the running total is non-decreasing)
    value = float((slopes[:full] * lengths[:full]).sum())
    if full < len(lengths):  # the last piece, filled in part
        value += float(slopes[full] * (1 - (filled[full - 1] if full else 0)))
    return value


def candidates_of(p_t: torch.Tensor, mass: float, most: int,
                  exclude: list[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The most likely tokens under p_t until they cover `mass` (at most `most`, none of `exclude`): (tokens,
    their weights renormalised to 1, the mass they cover)."""
    probs = p_t.clone()
    probs[exclude] = 0
    top = torch.topk(probs, min(most, int((probs > 0).sum())))
    keep = int(torch.searchsorted(top.values.cumsum(0), torch.tensor(mass))) + 1
    tokens, weights = top.indices[:keep], top.values[:keep]
    return tokens, weights / weights.sum(), float(weights.sum())


def sat_draft(sat_model, chooser, cache, pending: int) -> torch.Tensor:
    """SAT 1's warped distribution (V,) from the draft pass [pending, SAT 1] over the cache; the cache is left
    as it was."""
    from ..kvcache import rollback

    base, device = cache.get_seq_length(), sat_model.device
    slots = torch.cat([torch.tensor([-1], device=device), sat_model.sat_block(1)])[None]
    logits = sat_model.forward(torch.tensor([[pending, 0]], device=device), slots, cache=cache)[0]
    rollback(cache, base)
    return chooser.probs(logits[1:])[0]


def measure_prompt(sat_model, adapters: dict[str, object], chooser, prompt_ids: list[int], max_new_tokens: int,
                   eos_ids: list[int], mass: float, most: int) -> list[dict[str, float]]:
    """Rates at every position of one sampled decode whose next two tokens could both be output."""
    from transformers import DynamicCache

    cache, rows = DynamicCache(config=sat_model.model.config), []
    device = sat_model.device
    with torch.inference_mode():
        if len(prompt_ids) > 1:
            sat_model.forward(torch.tensor([prompt_ids[:-1]], device=device), cache=cache, logits_to_keep=1)
        pending = prompt_ids[-1]
        for n in range(max_new_tokens):
            sat_q = {name: sat_draft(model, chooser, cache, pending) for name, model in adapters.items()}
            p_t = chooser.probs(sat_model.forward(torch.tensor([[pending]], device=device), cache=cache)[0, -1:])[0]
            if n + 1 < max_new_tokens:
                tokens, weights, covered = candidates_of(p_t, mass, most, eos_ids)
                if len(tokens):
                    after = candidate_distributions(sat_model, chooser, cache, tokens)
                    rows.append(blind_rates(after, weights, sat_q) | {"covered": covered})
            pending = chooser.sample(p_t)
            if pending in eos_ids:
                break
    return rows


def measure(engine, adapter_dirs: list[Path], suites: dict[str, list], settings: list[tuple[float, float]],
            max_new_tokens: int, mass: float = 0.99, most: int = 32, log=lambda line: None) -> dict:
    """{suite: {"T,top_p": {"positions": n, "covered": mean mass of the candidates, "rates": {column: mean
    a(q)}}}} over each suite's prompts, prompt i sampled with seed i."""
    from ..sampling import SamplingConfig, TokenChooser
    from ..sat import SatAdapter, SatModel, SatSpec

    base, adapters = engine.sat_model, {}
    try:
        for folder in adapter_dirs:
            adapter = SatAdapter.load(folder)
            adapters[str(folder)] = SatModel(base.model, SatSpec(kind="adapter", max_k=1, adapter=str(folder)),
                                             adapter)
        results = {}
        for suite, prompts in suites.items():
            results[suite] = {}
            for temperature, top_p in settings:
                rows = []
                for i, prompt in enumerate(prompts):
                    sampling = SamplingConfig(do_sample=True, temperature=temperature, top_p=top_p, seed=i)
                    rows += measure_prompt(base, adapters, TokenChooser(sampling, base.device),
                                           engine.encode(prompt.text, chat=prompt.kind == "chat"), max_new_tokens,
                                           engine.eos_ids, mass, most)
                columns = [key for key in (rows[0] if rows else {}) if key != "covered"]
                entry = {"positions": len(rows),
                         "covered": round(statistics.fmean(r["covered"] for r in rows), 4) if rows else 0.0,
                         "rates": {c: round(statistics.fmean(r[c] for r in rows), 4) for c in columns}}
                results[suite][f"{temperature:g},{top_p:g}"] = entry
                log(f"{suite} T {temperature:g} top-p {top_p:g}: {json.dumps(entry)}")
    finally:
        for model in adapters.values():
            model.adapter.detach()
    return results


def main(argv: list[str] | None = None) -> int:
    from ..cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.ceiling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapters", nargs="*", metavar="ADAPTER_DIR", help="SAT adapters to set beside the bounds")
    parser.add_argument("--humaneval", default="16-35", metavar="SPEC",
                        help='HumanEval problems ("" for none; default 16-35, held out from the acceptance trace)')
    parser.add_argument("--prompts", nargs="*", default=["assets/prompts/heldout_chat.jsonl"], metavar="FILE",
                        help="prompt files, one suite each (default: the held-out chat prompts)")
    parser.add_argument("--sampled", nargs="+", default=["0.7,0.95", "1,1"], metavar="T,TOP_P",
                        help="sampling settings (default 0.7,0.95 1,1)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="sampled tokens per prompt")
    parser.add_argument("--mass", type=float, default=0.99,
                        help="the candidates for t cover this much of p(t | h) (default 0.99)")
    parser.add_argument("--candidates", type=int, default=32, metavar="N", help="at most this many (default 32)")
    parser.add_argument("--dtype", default="bfloat16", help="precision of the model (default bfloat16)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    parser.add_argument("--out", metavar="FILE", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2:
        raise ValueError(f"max_new_tokens must be at least 2, got {args.max_new_tokens}")
    if not 0 < args.mass <= 1:
        raise ValueError(f"mass must be in (0, 1], got {args.mass}")
    if not 1 <= args.candidates <= 256:
        raise ValueError(f"candidates must be between 1 and 256, got {args.candidates}")
    from .drafts import sampling_settings

    settings = sampling_settings(args.sampled)
    for folder in args.adapters:
        if not (Path(folder) / "adapter_config.json").is_file():
            raise ValueError(f"{folder} is not a SAT adapter folder (no adapter_config.json)")

    from ..engine import Engine
    from ..models import DEFAULT_MODEL, LoadConfig
    from .prompts import file_prompts, humaneval_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    suites = {f"HumanEval {args.humaneval}": humaneval_prompts(args.humaneval)} if args.humaneval else {}
    suites.update({Path(p).stem: file_prompts(p) for p in args.prompts})
    engine = Engine.load(LoadConfig(model=DEFAULT_MODEL, dtype=args.dtype, measure_kernels=False))
    results = measure(engine, [Path(a) for a in args.adapters], suites, settings, args.max_new_tokens, args.mass,
                      args.candidates, log=lambda line: print(line, file=sys.stderr, flush=True))
    command = "python -m sdsat.bench.ceiling " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.out:
        Path(args.out).write_text(json.dumps({"command": command, "suites": results}, indent=1) + "\n")
    print("How often SAT 1's draft passes its accept test, averaged over the pass's own token t")
    for suite, entries in results.items():
        for setting, entry in entries.items():
            print(f"{suite}, T,top-p {setting} ({entry['positions']} positions, candidates cover "
                  f"{entry['covered']:.3f} of p(t | h)):")
            for column, rate in entry["rates"].items():
                print(f"  {column:<40} {rate:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
