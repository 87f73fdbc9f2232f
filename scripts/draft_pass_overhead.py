"""What a draft pass [t, SAT×3] costs over a plain pass of 4 tokens, and how much of that is the SAT updates'
arithmetic and how much their Python.

    python scripts/draft_pass_overhead.py                 # 200 rounds
    python scripts/draft_pass_overhead.py --rounds 80

The default model in bfloat16, in the first row-invariant form SDSAT decodes in, behind 256 cached tokens. Each
round times a plain pass of 4 tokens and a draft pass back to back (in alternating order) under four settings
in turns: the compiled update (as shipped); the same draft pass followed by the sampler head's three drafts (as
decoding drafts, greedy); a stand-in kernel that returns at once (the hooks' Python alone); no SAT updates at all
(the SAT rows and their embeddings only). Medians of the per-round draft ÷ plain ratios: adjacent passes share
the VM's mood, which whole-run medians of each pass do not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from sdsat import sat_kernel, timing, tuning
    from sdsat.engine import Engine
    from sdsat.head import head_drafts
    from sdsat.sampling import SamplingConfig, TokenChooser
    from sdsat.hardware import cpu_name
    from sdsat.kvcache import new_cache, rollback
    from sdsat.models import DEFAULT_MODEL, LoadConfig

    torch.set_num_threads(args.threads)
    engine = Engine.load(LoadConfig(model=DEFAULT_MODEL))
    form = tuning.exact_forms("bfloat16")[0]
    tuning.set_precision(engine.sat_model, "bfloat16", True, form)
    sat_model, adapter = engine.sat_model, engine.sat_model.adapter
    if sat_kernel.build() is None:
        sys.exit("the compiled update is not available here (see the log), or SDSAT_SAT_KERNEL=0")
    hooks, compiled = list(adapter._hooks), sat_kernel.compiled
    returns_at_once = type("ReturnsAtOnce", (), {"sat_update": lambda self, *args: True})()

    def setting(kernel, with_updates: bool = True):
        def apply():
            sat_kernel.compiled = kernel
            adapter._hooks = hooks if with_updates else [hook for hook in hooks if hook[2]]  # pre-hooks stay
        return apply

    settings = {"compiled update": setting(compiled), "compiled update + sampler head": setting(compiled),
                "hooks' Python alone": setting(lambda: returns_at_once),
                "no SAT updates": setting(compiled, with_updates=False)}
    head, chooser = sat_model.sampler, TokenChooser(SamplingConfig(), sat_model.device)
    if head is None or not sat_model.plain_head:
        del settings["compiled update + sampler head"]
    embed_in = sat_model.model.get_input_embeddings().weight
    embed_out = sat_model.model.get_output_embeddings().weight
    history = list(range(1000, 1000 + 256))
    vocab = embed_in.shape[0]
    gen = torch.Generator().manual_seed(0)
    cache, context = new_cache(sat_model.model.config), 256
    with torch.inference_mode():
        sat_model.forward(torch.randint(0, vocab, (1, context), generator=gen), cache=cache, logits_to_keep=1)
    ratios = {name: [] for name in settings}
    drafts = {name: [] for name in settings}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for name, apply in settings.items():
            apply()
            seconds = {}
            for kind in ("plain", "draft") if round_ % 2 else ("draft", "plain"):
                ids = torch.randint(0, vocab, (1, 4), generator=gen)
                slots = None if kind == "plain" else torch.tensor([[-1, 0, 1, 2]])
                start = timing.now()
                with torch.inference_mode():
                    if kind == "draft" and name.endswith("sampler head"):  # as drafters.conditioned_draft_pass
                        hidden = sat_model.hidden_states(ids, slots, cache=cache)[0]
                        logits = sat_model.head(hidden)
                        head_drafts(head, hidden[1:], logits[1:], int(logits[0].argmax()), embed_in, embed_out,
                                    chooser.probs, chooser.draw, history)
                    else:
                        sat_model.forward(ids, slots, cache=cache, logits_to_keep=4)
                seconds[kind] = timing.now() - start
                rollback(cache, context)
            if round_:
                ratios[name].append(seconds["draft"] / seconds["plain"])
                drafts[name].append(seconds["draft"])
    setting(compiled)()
    print(f"{cpu_name()}, {args.threads} threads, bfloat16 {form}, {args.rounds} rounds")
    print("| setting | draft ÷ plain 4 (median) | quartiles | draft pass ms (median) |")
    print("|---|---:|---:|---:|")
    for name in settings:
        r = sorted(ratios[name])
        print(f"| {name} | {statistics.median(r):.3f} | {r[len(r) // 4]:.3f}–{r[3 * len(r) // 4]:.3f} | "
              f"{statistics.median(drafts[name]) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
