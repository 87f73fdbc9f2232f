"""Does torch.compile pay on this machine? The default model's one-token pass, timed in turns:

  eager routed    the products this machine's kernel plan routes (the fastest vanilla's form here, or within a
                  few percent of it: the tuning names either it or the row-invariant keyed form)
  eager plain     nn.Linear products and SDPA attention, as transformers runs the model
  compiled plain  the plain form through torch.compile (inductor, dynamic shapes)

    python scripts/compile_trial.py --precision bfloat16 --rounds 8

Only the plain form is compiled: inductor cannot lower the routed products' oneDNN packed weights, and the
plain form's products are not row-invariant, so SDSAT cannot decode in it (docs/results.md, "torch.compile").
All three use transformers' DynamicCache, so the decoders' in-place cache helps none of them. Where this
machine has no kernel plan kept yet, the routed form measures one first (a minute or two).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from sdsat import tuning
from sdsat.engine import Engine
from sdsat.hardware import cpu_name
from sdsat.models import LoadConfig

FORMS = ("eager routed", "eager plain", "compiled plain")


def one_token_s(model: torch.nn.Module, context: torch.Tensor, steps: int) -> float:
    """The median one-token pass behind `context`, after four passes of warm-up."""
    cache = DynamicCache(config=model.config)
    token = torch.tensor([[5]])
    seconds = []
    with torch.inference_mode():
        model(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(steps + 4):
            start = time.perf_counter()
            model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bfloat16", choices=tuning.CPU_PRECISIONS)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of the three forms in turns (default 8)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens behind each pass (default 256)")
    parser.add_argument("--steps", type=int, default=20, help="timed passes per form and round (default 20)")
    args = parser.parse_args()
    routed, plain = (Engine.load(LoadConfig(device="cpu")) for _ in range(2))  # the CPU's forms, a GPU or not
    tuning.set_precision(routed.sat_model, args.precision, kernels=True, form=tuning.ROUTED)
    tuning.set_precision(plain.sat_model, args.precision, kernels=False, form=tuning.ROUTED)
    compiled = torch.compile(plain.sat_model.model, dynamic=True)
    models = dict(zip(FORMS, (routed.sat_model.model, plain.sat_model.model, compiled)))
    context = torch.randint(100, 20000, (1, args.context), generator=torch.Generator().manual_seed(0))

    start = time.perf_counter()
    one_token_s(compiled, context, steps=2)
    print(f"compiling and the first passes: {time.perf_counter() - start:.0f} s", flush=True)
    with torch.inference_mode():  # the same logits, to the precision's rounding (compiled kernels fuse differently)
        eager_logits = plain.sat_model.model(input_ids=context).logits[0, -1].float()
        compiled_logits = compiled(input_ids=context).logits[0, -1].float()
    print(f"last-row logits, compiled vs eager: max |difference| "
          f"{(eager_logits - compiled_logits).abs().max().item():.3g}, same argmax: "
          f"{bool(eager_logits.argmax() == compiled_logits.argmax())}", flush=True)

    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for round_ in range(args.rounds):
        for form in FORMS if round_ % 2 == 0 else FORMS[::-1]:
            times[form].append(one_token_s(models[form], context, args.steps))
        print(f"round {round_ + 1}: " + ", ".join(f"{f} {t[-1] * 1e3:.1f} ms" for f, t in times.items()), flush=True)
    base = times["eager routed"]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {args.precision}, {args.context} cached tokens")
    for form, seconds in times.items():
        ratio = statistics.median(s / b for s, b in zip(seconds, base))
        print(f"  {form:<15} {statistics.median(seconds) * 1e3:6.1f} ms   {ratio:.3f}× eager routed (median per round)")


if __name__ == "__main__":
    main()
