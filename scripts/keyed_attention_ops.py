"""Where a lone row's keyed attention spends its time, and what its one-token pass costs beside the per-row form's.

    python scripts/keyed_attention_ops.py                 # op by op, one thread, a lone row behind --keys keys
    python scripts/keyed_attention_ops.py --passes 40     # also one-token passes of the default model, in turns:
                                                          # keyed, keyed on two threads, per-row

The op-by-op part times the scores' bfloat16 product over a view of the in-place cache's room (what the keyed
form read before it copied its keys dense) and over a dense copy, checks that both give the same bits, and
times the whole attention call of the keyed and per-row forms. Minimum over five batches of calls.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best_us(fn, calls: int = 2000) -> float:
    """Microseconds per call: the fastest of five batches, after a warm-up."""
    for _ in range(100):
        fn()
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        batches.append((time.perf_counter() - start) / (calls // 5) * 1e6)
    return min(batches)


def ops(keys: int) -> None:
    from sdsat import attention
    from sdsat.kvcache import InPlaceLayer

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    heads, kv_heads, dim = 9, 3, 64  # SmolLM2-135M's attention
    key, value = InPlaceLayer().update(*(torch.randn(1, kv_heads, keys, dim).bfloat16() for _ in range(2)))
    padded = -(-keys // attention.KEY_BLOCK) * attention.KEY_BLOCK
    room = attention._padded_float(key, padded, key.dtype)  # the view of the cache's room the keyed form reads
    dense = room.contiguous()
    q = torch.randn(kv_heads, heads // kv_heads, dim).bfloat16()
    same = torch.equal(torch.bmm(q, room.transpose(1, 2)), torch.bmm(q, dense.transpose(1, 2)))
    print(f"a lone row behind {keys} keys (padded to {padded}), one thread; the same bits: {same}")
    print(f"  scores' product over the room's view  {best_us(lambda: torch.bmm(q, room.transpose(1, 2))):7.1f} µs")
    print(f"  scores' product over a dense copy     {best_us(lambda: torch.bmm(q, dense.transpose(1, 2))):7.1f} µs")
    print(f"  the copy                              {best_us(lambda: room.contiguous()):7.1f} µs")
    query = torch.randn(1, heads, 1, dim).bfloat16()
    for name, attend in (("keyed", attention.keyed_attention), ("per-row", attention.per_row_attention)):
        print(f"  {name} attention call{' ' * (22 - len(name))}"
              f"{best_us(lambda: attend(None, query, key, value, None, 0.125)):7.1f} µs")
    torch.set_num_threads(threads)


def passes(rounds: int) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from sdsat import attention, tuning
    from sdsat.bench.pass_cost import measure_settings
    from sdsat.engine import DEFAULT_ADAPTER, Engine, SatSource
    from sdsat.models import DEFAULT_MODEL, LoadConfig

    engine = Engine.load(LoadConfig(model=DEFAULT_MODEL, dtype="bfloat16"), SatSource(adapter=str(DEFAULT_ADAPTER)))
    tuning.set_precision(engine.sat_model, "bfloat16", True, tuning.KEYED)
    AttentionInterface.register("keyed_two_threads", attention.keyed_attention.__wrapped__)
    AttentionMaskInterface.register("keyed_two_threads", sdpa_mask)
    model = engine.model
    settings = {"keyed": lambda: model.set_attn_implementation(attention.KEYED),
                "keyed, two threads": lambda: model.set_attn_implementation("keyed_two_threads"),
                "per-row": lambda: model.set_attn_implementation(attention.PER_ROW)}
    costs = measure_settings(engine, [1], 256, rounds, settings)
    per_row = costs["per-row"]["plain"][1]
    print(f"one-token pass behind 256 cached tokens, {rounds} rounds in turns (÷ the per-row form's)")
    for name, cost in costs.items():
        print(f"  {name:20s} {cost['plain'][1] * 1e3:6.1f} ms  {cost['plain'][1] / per_row:.3f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=300, help="cached keys the lone row attends over (default 300)")
    parser.add_argument("--passes", type=int, default=0, metavar="ROUNDS",
                        help="also time one-token passes of the default model in turns (default: skip)")
    args = parser.parse_args()
    ops(args.keys)
    if args.passes:
        passes(args.passes)


if __name__ == "__main__":
    main()
