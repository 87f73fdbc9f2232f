"""`python -m sdsat.bench.sampling_cost`: what turning logits into a sampled token costs, per row.

Every sampled token, vanilla or speculative, goes through the warpers (temperature, top-k, top-p) and
one draw; SDSAT does it for every verified row and every drafted one. This times, on the real model's
logits after a code prompt, transformers' top-p warper against the project's partial-sort one
(`sampling.PartialSortTopP`), and torch.multinomial against the sampler's draws by inverse CDF (one
token; tree siblings without replacement), interleaved call by call; medians are reported. Each pair
gives the same distributions (tests/test_sampling.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import TopPLogitsWarper

PROMPT = 'def fizzbuzz(n: int) -> list[str]:\n    """Return the FizzBuzz strings from 1 to n."""\n    out = []\n'


def measure(logits: torch.Tensor, top_p: float, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median milliseconds of each way over `logits` (N, V), already divided by the temperature."""
    from ..sampling import PartialSortTopP, SamplingConfig, TokenChooser

    probs = torch.softmax(logits, -1)
    chooser = TokenChooser(SamplingConfig(do_sample=True, seed=seed), logits.device)
    generator = torch.Generator(device=logits.device).manual_seed(seed)
    ways = {
        "top-p, transformers' warper": lambda: TopPLogitsWarper(top_p)(None, logits.clone()),
        "top-p, partial sort (sdsat)": lambda: PartialSortTopP(top_p)(None, logits.clone()),
        "draw, torch.multinomial": lambda: torch.multinomial(probs, 1, generator=generator),
        "draw, inverse CDF (sdsat)": lambda: chooser.draw(probs),
        "4 siblings, torch.multinomial": lambda: [torch.multinomial(row, 4, generator=generator) for row in probs],
        "4 siblings, inverse CDF (sdsat)": lambda: chooser.draw_ranked(probs, 4),
    }
    times = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) * 1e3 for name, seconds in times.items()}


def main(argv: list[str] | None = None) -> int:
    from ..cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    from ..engine import Engine
    from ..hardware import hardware_line

    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.sampling_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="rows warped at once (default 1 4)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load()
    engine.use_stored_tuning()
    ids = engine.encode(PROMPT)
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([ids], device=engine.sat_model.device)).logits[0].float()
    print(f"{hardware_line(engine.model)}; T {args.temperature:g}, "
          f"top-p {args.top_p:g}; milliseconds per call (median of {args.repeats})")
    for rows in args.rows:
        rows = min(rows, len(logits))
        costs = measure(logits[-rows:] / args.temperature, args.top_p, args.repeats)
        print(f"{rows} row(s): " + "; ".join(f"{name} {ms:.2f}" for name, ms in costs.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
