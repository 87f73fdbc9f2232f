"""`python -m sdsat.bench.pass_split`: where a forward pass's time goes, and a decoding loop's around its passes.

A pass's time is split as `sdsat/pass_parts.py` splits it: the decoder layers' products, attention, the SAT
updates, norms and rotary embeddings, the output head, and the rest. A decode's time is split into its forward
passes (a pass's output head included, where its rows are projected after it), choosing tokens (TokenChooser),
KV-cache surgery (kvcache.py) and the loop's own Python, timed the same way: by wrapping the callables that do each
part, so that "loop Python" is what the others leave.

Beside a decode's split it prints the speed-up its passes allow: the arithmetic bound is the vanilla decode's
seconds per pass times the SDSAT decode's tokens, over the SDSAT decode's pass seconds; the measured speed-up
falls short of it by what the loop spends outside its passes (issue 38, item 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .. import drafters, kvcache, sat, timing, verify
from .. import decoding as decoding_module
from ..pass_parts import PASS_PARTS, Split, Timer, patched, split_passes, with_rest
from ..sampling import SamplingConfig, TokenChooser

PASSES, CHOOSING, SURGERY, LOOP = "forward passes", "choosing tokens", "KV-cache surgery", "loop Python"
LOOP_PARTS = (PASSES, CHOOSING, SURGERY, LOOP)


def split_decode(engine, prompt_ids: list[int], config) -> tuple[Split, object]:
    """Run one decode (decoding.decode) with its loop timed: (the split, the GenerationResult)."""
    timer = Timer(engine.sat_model.device)
    passes = [(module, "call_with_cache", timer.wrap(PASSES, module.call_with_cache))
              for module in (decoding_module, sat)]
    # A pass that returns hidden states (a draft pass read by the sampler head, the fused verify) has its rows
    # projected onto the vocabulary afterwards: that output head is the pass's, as it is inside `forward`.
    passes.append((engine.sat_model, "head", timer.wrap(PASSES, engine.sat_model.head)))
    choosing = [(TokenChooser, name, timer.wrap(CHOOSING, getattr(TokenChooser, name)))
                for name in ("choose", "probs", "draw", "draw_ranked") if hasattr(TokenChooser, name)]
    surgery = [(module, name, timer.wrap(SURGERY, getattr(kvcache, name)))
               for module in (kvcache, drafters, verify) for name in ("rollback", "keep_rows")
               if hasattr(module, name)]
    with patched(passes + choosing + surgery):
        start = timing.now(engine.sat_model.device)
        result = decoding_module.collect(decoding_module.decode(engine.sat_model, engine.tokenizer, prompt_ids,
                                                                config, engine.eos_ids))
        total = timing.now(engine.sat_model.device) - start
    return with_rest(total, timer.seconds, LOOP_PARTS), result


def arithmetic_bound(vanilla: tuple[Split, object], sdsat: tuple[Split, object]) -> dict[str, float]:
    """The speed-up SDSAT's passes allow over vanilla's (vanilla's seconds per pass times SDSAT's new tokens,
    over SDSAT's pass seconds) beside the measured one (tokens per second, same prompt and run)."""
    (v_split, v_result), (s_split, s_result) = vanilla, sdsat
    v_tokens, s_tokens = len(v_result.token_ids), len(s_result.token_ids)
    v_per_pass = v_split.parts[PASSES] / max(len(v_result.steps), 1)
    bound = v_per_pass * s_tokens / s_split.parts[PASSES]
    measured = (s_tokens / s_split.total_s) / (v_tokens / v_split.total_s)
    return {"bound": bound, "measured": measured, "share_of_bound": measured / bound}


def table(splits: dict[str, Split], parts: tuple[str, ...]) -> str:
    """A markdown table: ms per part and its share of the total, one row per measured span."""
    lines = ["| span | total ms | " + " | ".join(parts) + " |", "|---|---:|" + "---:|" * len(parts)]
    for label, split in splits.items():
        cells = [f"{split.parts[p] * 1e3:.1f} ({split.parts[p] / split.total_s:.0%})" for p in parts]
        lines.append(f"| {label} | {split.total_s * 1e3:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def suite_bounds(engine, prompts: list, configs: dict) -> str:
    """Each prompt's measured speed-up beside its arithmetic bound (both decodes split on it), and the share of
    the bound over the prompts: where a suite's loop loses time outside its passes."""
    lines = ["| prompt | SDSAT tokens / iteration | measured | bound | share of bound |", "|---|---:|---:|---:|---:|"]
    shares, totals = [], dict.fromkeys(("v_tokens", "v_seconds", "s_tokens", "s_seconds", "iterations"), 0.0)
    for prompt in prompts:
        ids = engine.encode(prompt.text, chat=prompt.kind == "chat")
        loops = {method: split_decode(engine, ids, config) for method, config in configs.items()}
        bound = arithmetic_bound(loops["vanilla"], loops["sdsat"])
        result = loops["sdsat"][1]
        shares.append(bound["share_of_bound"])
        for side, (split, decoded) in (("v", loops["vanilla"]), ("s", loops["sdsat"])):
            totals[f"{side}_tokens"] += len(decoded.token_ids)
            totals[f"{side}_seconds"] += split.total_s
        totals["iterations"] += len(result.steps)
        lines.append(f"| {prompt.name} | {len(result.token_ids) / max(len(result.steps), 1):.2f} | "
                     f"{bound['measured']:.2f}x | {bound['bound']:.2f}x | {bound['share_of_bound']:.0%} |")
    if not shares:
        raise ValueError("no prompts to split")
    shares.sort()
    lines.append(f"\nshare of the bound over {len(shares)} prompts: median {shares[(len(shares) - 1) // 2]:.0%}, "
                 f"lowest {shares[0]:.0%}")
    lines.append(iteration_cost(**totals))
    return "\n".join(lines)


def iteration_cost(v_tokens: float, v_seconds: float, s_tokens: float, s_seconds: float, iterations: float) -> str:
    """Over a suite: what an SDSAT iteration costs in vanilla's seconds per token, C, beside its tokens per
    iteration, T. The suite's speed-up (all tokens over all seconds, prefills included) is exactly T / C, so a
    speed-up S needs S * C tokens per iteration at this cost."""
    per_token = v_seconds / v_tokens
    cost, tokens = s_seconds / iterations / per_token, s_tokens / iterations
    return (f"over the suite: an iteration costs {cost:.2f} of vanilla's tokens ({s_seconds / iterations * 1e3:.1f} "
            f"against {per_token * 1e3:.1f} ms) and gives {tokens:.2f}: {tokens / cost:.2f}x, all tokens over all "
            f"seconds; each 0.1x more needs {0.1 * cost:.2f} more tokens an iteration at this cost")


BLOCKS = {"one token (vanilla)": ("plain", 1), "plain 4 tokens (verify, k = 3)": ("plain", 4),
          "draft [t, SAT x3]": ("draft", 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.pass_split", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256, metavar="N",
                        help="tokens already in the KV cache (default 256)")
    parser.add_argument("--repeats", type=int, default=10, metavar="N",
                        help="timed rounds over every block; medians are reported (default 10)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                        help="the prompt the decodes' loops are split on")
    source.add_argument("--prompts", metavar="FILE",
                        help="split the loops on every prompt of this file (the benchmark's JSON lines) and report "
                             "each one's share of its bound")
    source.add_argument("--subset", metavar="SPEC", help="the same on these HumanEval problems, e.g. 16-35")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="new tokens per decode (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="sample at this temperature, vanilla and SDSAT alike (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus when sampling (default 1)")
    parser.add_argument("--plan", choices=("auto", "paper"), default="auto",
                        help="SDSAT's plan: auto's for this machine, or the paper's scheme alone (two_step, k = 3, a "
                             "chain of SAT drafts: no prompt lookup, no tree) (default auto)")
    parser.add_argument("--json", metavar="OUT", help="also write the splits (seconds) here (default: none)")
    args = parser.parse_args(argv)
    sampling = SamplingConfig(do_sample=args.temperature > 0, temperature=args.temperature or 1.0,
                              top_p=args.top_p, seed=0)
    try:
        sampling.validate()
    except ValueError as err:
        parser.error(str(err))

    from ..config import DecodeConfig
    from ..engine import Engine
    from ..models import DEFAULT_MODEL, LoadConfig, ModelLoadError
    from .runner import machine_info

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        engine = Engine.load(LoadConfig(model=DEFAULT_MODEL, measure_kernels=False))
    except (ModelLoadError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    engine.use_stored_tuning()
    configs = {method: engine.auto_config(DecodeConfig(method=method, max_new_tokens=args.max_new_tokens,
                                                       sampling=sampling)) for method in ("vanilla", "sdsat")}
    if args.plan == "paper":  # as the page's "paper" preset
        from ..ui.presets import FIXED

        configs["sdsat"] = DecodeConfig(method="sdsat", max_new_tokens=args.max_new_tokens, sampling=sampling,
                                        scheme="two_step", **FIXED["paper"])
    if args.prompts or args.subset:
        from .prompts import PromptFileError, file_prompts, humaneval_prompts

        try:
            prompts = file_prompts(args.prompts) if args.prompts else humaneval_prompts(args.subset)
        except (PromptFileError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{machine_info(engine).get('cpu', '')}, {torch.get_num_threads()} threads")
        print(suite_bounds(engine, prompts, configs))
        return 0
    passes = split_passes(engine.sat_model, BLOCKS, args.context, args.repeats)
    prompt_ids = engine.tokenizer(args.prompt)["input_ids"]
    loops = {method: split_decode(engine, prompt_ids, config) for method, config in configs.items()}
    bound = arithmetic_bound(loops["vanilla"], loops["sdsat"])
    info = machine_info(engine)
    print(f"{info.get('cpu', '')}, {torch.get_num_threads()} threads, KV cache of {args.context} tokens; "
          f"ms of the median pass (its parts add up to it) and each part's share")
    print(table(passes, PASS_PARTS))
    print()
    print(table({method: split for method, (split, _) in loops.items()}, LOOP_PARTS))
    print(f"\nSDSAT over vanilla on this prompt: measured {bound['measured']:.2f}x, arithmetic bound of its passes "
          f"{bound['bound']:.2f}x ({bound['share_of_bound']:.0%} of it)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "machine": info, "context": args.context, "passes": {k: v.to_dict() for k, v in passes.items()},
            "loops": {k: v.to_dict() for k, (v, _) in loops.items()}, "speed_up": bound}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
