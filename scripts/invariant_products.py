"""What the products of a whole pass cost through each row-invariant kernel, and through `nn.Linear` in bfloat16.

    python scripts/invariant_products.py                  # 1, 4, 8 and 64 rows
    python scripts/invariant_products.py --rows 1 4

The default model's own linear weights (every layer's products and the output head), in float32 and as bfloat16
copies, multiplied by random rows: oneDNN's float32 chunks (the row-invariant form before the compiled product),
the compiled product on float32 and on bfloat16 weights, and `nn.Linear` in bfloat16 (not row-invariant; oneDNN
emulates bfloat16 on CPUs without its instructions). Each row count times every kernel in turns, fastest of
`--rounds` rounds, ms for all of a pass's products.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 64])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from sdsat import cpu_kernels, native
    from sdsat.engine import Engine
    from sdsat.hardware import cpu_name

    torch.set_num_threads(args.threads)
    if native.build() is None:
        sys.exit(f"the compiled kernels cannot be built here ({native._failed})")
    engine = Engine.load()
    cpu_kernels.uninstall(engine.model)
    weights = [m.weight.detach().float() for mods in cpu_kernels._groups(engine.model).values() for m in mods]
    halves = [w.bfloat16() for w in weights]
    chunks = [cpu_kernels._pack_chunks(w, cpu_kernels.MAX_ROWS) for w in weights]
    kinds = {  # name: (variant, weights, packs, input dtype)
        "oneDNN float32 chunks": ("invariant", weights, chunks, torch.float32),
        "ours, float32 weights": ("native", weights, [None] * len(weights), torch.float32),
        "ours, bfloat16 weights": ("native", halves, [None] * len(weights), torch.bfloat16),
        "nn.Linear bfloat16": ("linear", halves, [None] * len(weights), torch.bfloat16),
    }
    gen = torch.Generator().manual_seed(0)
    print(f"{cpu_name()}, {args.threads} threads, {len(weights)} products per pass; ms, fastest of {args.rounds}")
    print("| rows | " + " | ".join(kinds) + " |")
    print("|---:|" + "---:|" * len(kinds))
    with torch.inference_mode():
        for rows in args.rows:
            by_width = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for w in weights}
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(args.rounds):
                for name, (variant, ws, packs, dtype) in kinds.items():
                    inputs = [by_width[w.shape[1]].to(dtype) for w in ws]
                    best[name] = min(best[name], cpu_kernels._fastest((variant,), inputs, ws, packs, 1)[variant])
            print(f"| {rows} | " + " | ".join(f"{best[name] * 1e3:.1f}" for name in kinds) + " |")


if __name__ == "__main__":
    main()
