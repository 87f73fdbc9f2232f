"""`python -m sdsat.bench.pass_cost`: what one forward pass over T new tokens costs, relative to one token.

Speculative decoding pays off when tokens per forward pass exceed the relative cost of its wider
passes: speed-up ≈ tokens per pass ÷ cost(T) / cost(1). On a GPU cost(T) stays near cost(1) for small
T; on a CPU a one-token pass multiplies matrices by a vector, a wider one by a matrix, and the two
kernels differ. This measures it on the loaded model, with a KV cache of `--context` tokens, for
plain causal blocks (what vanilla, prompt lookup and SDSAT's verify pass feed) and for SDSAT draft
blocks [token, SAT x k]. Sizes are interleaved in every repeat; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from ..decoding import _rollback


def measure(engine, sizes: list[int], context: int, repeats: int, seed: int = 0) -> dict:
    """Median seconds per pass: {"plain": {T: s}, "draft": {k: s}} (draft blocks are k + 1 tokens)."""
    model, sat_model = engine.model, engine.sat_model
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    device = sat_model.device
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, context), generator=gen).to(device), cache=cache, use_cache=True,
              logits_to_keep=1)
    times: dict[str, dict[int, list[float]]] = {"plain": {t: [] for t in sizes},
                                                "draft": {t - 1: [] for t in sizes if 1 <= t - 1 <= sat_model.max_k}}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        for kind, table in times.items():
            for size in table:
                ids = torch.randint(0, vocab, (1, size if kind == "plain" else size + 1), generator=gen).to(device)
                slots = None if kind == "plain" else torch.cat([torch.tensor([-1]), torch.arange(size)])[None].to(device)
                start = time.perf_counter()
                with torch.inference_mode():
                    sat_model.forward(ids, slots, cache=cache, logits_to_keep=ids.shape[1])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                table[size].append(time.perf_counter() - start)
                _rollback(cache, context)
    return {kind: {size: statistics.median(v[1:]) for size, v in table.items()} for kind, table in times.items()}


def report(costs: dict, context: int) -> str:
    one = costs["plain"][min(costs["plain"])]
    lines = [f"KV cache of {context} tokens; median ms per pass (relative to a one-token pass)", "",
             "| block | tokens | ms | relative |", "|---|---:|---:|---:|"]
    for size, s in costs["plain"].items():
        lines.append(f"| plain causal | {size} | {s * 1e3:.1f} | {s / one:.2f}× |")
    for k, s in costs["draft"].items():
        lines.append(f"| draft [t, SAT×{k}] | {k + 1} | {s * 1e3:.1f} | {s / one:.2f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.pass_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 3, 4, 6, 8, 12, 16], help="block sizes T")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the KV cache (default 256)")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--no-cpu-kernels", action="store_true",
                        help="on a CPU, multiply with nn.Linear as is, not with the fastest "
                       "measured kernel per row count (cpu_kernels.py)")
    parser.add_argument("--json", metavar="OUT", help="also write the medians and the machine here")
    args = parser.parse_args(argv)
    if min(args.tokens) < 1 or args.context < 1 or args.repeats < 1:
        parser.error("--tokens, --context and --repeats must be at least 1")

    from ..engine import Engine
    from ..models import DEFAULT_MODEL, LoadConfig, ModelLoadError
    from .runner import machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = Engine.load(LoadConfig(model=args.model or DEFAULT_MODEL, cpu_kernels=not args.no_cpu_kernels))
    except (ModelLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sizes = sorted(set(args.tokens) | {1})
    costs = measure(engine, sizes, args.context, args.repeats)
    print(report(costs, args.context))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"context": args.context, "repeats": args.repeats,
                                               "machine": machine_info(engine), "seconds": costs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
