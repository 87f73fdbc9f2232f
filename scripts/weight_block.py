"""Whole passes of the tuned default model with its weights as separate tensors and in one block (weight_memory).

    python scripts/weight_block.py            # 40 rounds, 1- and 4-token passes over 256 cached tokens

Two engines of the same model in the tuned form: one's weights gathered into one block (huge pages where granted),
the other's copied back out into separate tensors; their passes interleaved, the order alternating by round.
Prints the median time per pass and the median ratio gathered ÷ separate, and whether the logits are bit-equal.
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
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from sdsat import weight_memory
    from sdsat.engine import Engine
    from sdsat.hardware import cpu_name
    from sdsat.kvcache import new_cache, rollback

    torch.set_num_threads(args.threads)
    gathered = Engine.load()
    gathered.use_stored_tuning()
    separate = gathered.twin()
    separate.use_stored_tuning()
    with torch.no_grad():
        for p in separate.model.parameters():
            p.data = p.data.clone()  # each its own allocation again
    print(f"{cpu_name()}, {args.threads} threads; one block: {weight_memory.gather(gathered.model)}, "
          f"separate: {not weight_memory.gathered(separate.model)}")
    engines = {"separate": separate, "one block": gathered}
    gen = torch.Generator().manual_seed(0)
    caches, seconds = {}, {(name, rows): [] for name in engines for rows in (1, 4)}
    with torch.inference_mode():
        context = torch.randint(0, 40000, (1, 256), generator=gen)
        for name, engine in engines.items():
            caches[name] = new_cache(engine.model.config)
            engine.sat_model.forward(context, cache=caches[name], logits_to_keep=1)
        for round_ in range(args.rounds):
            for rows in (1, 4):
                ids = torch.randint(0, 40000, (1, rows), generator=gen)
                for name in (list(engines) if round_ % 2 else list(engines)[::-1]):
                    start = time.perf_counter()
                    engines[name].sat_model.forward(ids, cache=caches[name], logits_to_keep=rows)
                    seconds[name, rows].append(time.perf_counter() - start)
                    rollback(caches[name], 256)
        ids = torch.randint(0, 40000, (1, 4), generator=gen)
        equal = torch.equal(*(engine.sat_model.forward(ids, cache=caches[name], logits_to_keep=4)
                              for name, engine in engines.items()))
    for rows in (1, 4):
        a, b = seconds["separate", rows], seconds["one block", rows]
        print(f"{rows} token(s): separate {statistics.median(a) * 1e3:.2f} ms, one block "
              f"{statistics.median(b) * 1e3:.2f} ms, ratio {statistics.median(y / x for x, y in zip(a, b)):.3f}")
    print(f"logits bit-equal: {equal}")


if __name__ == "__main__":
    main()
