"""`python -m sdsat.bench.acceptance`: measure the acceptance trace the `auto` planner replays.

For each prompt: vanilla's greedy output, then, at every output position, one draft pass [t, SAT×K] over
the true history, recording where each true next token ranks among the SAT's choices (planner.py). Then,
per sampling setting (T = 0.7 with top-p 0.95, T = 1, and the page's T = 0.8 with top-p 0.95 and top-k
50), sampled decodes of the same prompts with the largest draft tree and prompt lookup: how often the
i-th sibling tried at each depth passes its accept test, and how often each copy does
(`SampledAcceptance`), which the planner prices sampled settings with; and each sampled output, where the
planner looks for prompt lookup's copies when sampling (sampled text repeats itself less than greedy). The
trace depends on the model and its SATs, not on the machine, so it is measured once and shipped next to
the adapter (`acceptance.json`). The default prompts are HumanEval's last 16 problems, kept apart from
the benchmark's headline subset (0–15). Chat requests plan from a trace of their own where one ships
(`acceptance-chat.json`, measured with `--prompts assets/prompts/chat.jsonl`): chat drafts are right less often,
and chat text repeats its prompt less, than code.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from transformers import DynamicCache

from ..planner import CHAT_TRACE_FILE, LOOKUP_TOKENS, MISSED, TRACE_FILE, PromptTrace, SampledAcceptance, Trace
from ..tree import MAX_EXTRA

# (temperature, top_p, top_k) of the sampled acceptance measured: the benchmark's two settings, and the page's
# race defaults (ui.presets.PAGE_SAMPLING), whose top-k the others lack
SAMPLED = ((0.7, 0.95, 0), (1.0, 1.0, 0), (0.8, 0.95, 50))
MIN_TRIES = 20  # a pass rate from fewer tries is too thin to plan with


def ranks_along(sat_model, prompt_ids: list[int], output_ids: list[int], depth: int) -> list[list[int]]:
    """Per output position n, the ranks of output tokens n + 1 .. n + depth among SATs 1..depth at the draft
    pass fed the token before position n (positions past the output are left out of the row). With a sampler
    head (head.py), among the head's scores, SAT d conditioned on output token n + d - 1 (a token outside its
    candidates ranks after all of them)."""
    device = sat_model.device
    cache = DynamicCache(config=sat_model.model.config)
    seq = prompt_ids + output_ids
    slots = torch.cat([torch.tensor([-1]), torch.arange(depth)])[None].to(device)
    ranks = []
    head = sat_model.sampler if getattr(sat_model, "plain_head", False) else None
    text = torch.tensor(seq, device=device)
    embed_in = sat_model.model.get_input_embeddings().weight
    embed_out = sat_model.model.get_output_embeddings().weight
    with torch.inference_mode():
        if len(prompt_ids) > 1:
            sat_model.forward(torch.tensor([prompt_ids[:-1]], device=device), cache=cache, logits_to_keep=1)
        for n in range(len(output_ids)):
            t = seq[len(prompt_ids) + n - 1]
            ids = torch.tensor([[t] + [0] * depth], device=device)
            if head is None:
                logits = sat_model.forward(ids, slots, cache=cache, logits_to_keep=depth + 1)[0, 1:]
            else:  # the sampler head's scores, SAT d conditioned on the output token before the one it drafts
                hidden = sat_model.hidden_states(ids, slots, cache=cache)[0, 1:]
                ends = torch.arange(len(prompt_ids) + n, len(prompt_ids) + n + depth, device=device)
                ends = ends.clamp(max=len(seq) - 1)
                logits = head.logits(hidden, sat_model.head(hidden), text[ends], torch.arange(depth, device=device),
                                     embed_in, embed_out, text, ends)
            cache.crop(-depth)  # the SATs leave the cache, t stays
            row = []
            for d in range(1, depth + 1):
                if n + d >= len(output_ids):
                    break
                true = output_ids[n + d]
                row.append(min(int((logits[d - 1] > logits[d - 1, true]).sum()), MISSED))
            ranks.append(row)
    return ranks


def sampled_acceptance(engine, prompts, temperature: float, top_p: float, top_k: int,
                       max_new_tokens: int) -> SampledAcceptance:
    """Pass rates of sampled accept tests over seeded decodes of `prompts` with k = the SATs' depth, every
    runner-up of the draft tree and prompt lookup, every copy found verified (no gate, so that each copy position is
    tried wherever lookup finds one): per depth and try, and per copy. A sibling the tree had but q could not supply
    (top-k / top-p left fewer tokens) counts as a failed try, as the planner's replay assumes every sibling is
    there; a rate from fewer than MIN_TRIES tries is kept as 0."""
    from ..config import DecodeConfig
    from ..sampling import SamplingConfig

    tried, passed = Counter(), Counter()  # by ("sat", depth, attempt) or ("copy", position)
    outputs = []
    for seed, prompt in enumerate(prompts):
        config = DecodeConfig(method="sdsat", k=engine.max_k, max_new_tokens=max_new_tokens,
                              tree_candidates=MAX_EXTRA, lookup_tokens=LOOKUP_TOKENS, lookup_gate=False,
                              sampling=SamplingConfig(do_sample=True, temperature=temperature, top_p=top_p,
                                                      top_k=top_k, seed=seed))
        result = engine.generate(prompt.text, config, chat=prompt.kind == "chat")
        outputs.append(result.token_ids)
        for step in result.steps:
            if step.draft_source == "lookup":
                for test in step.accept_tests:
                    tried["copy", test.depth] += 1
                    passed["copy", test.depth] += test.accepted
                continue
            attempts = Counter()
            for test in step.accept_tests:
                tried["sat", test.depth, attempts[test.depth]] += 1
                passed["sat", test.depth, attempts[test.depth]] += test.accepted
                attempts[test.depth] += 1
            last = step.accept_tests[-1] if step.accept_tests else None
            if last is not None and not last.accepted:  # the walk ended at this depth: siblings not drawn failed
                walked = step.draft_ranks[:last.depth - 1]
                siblings = sum(len(path) == last.depth and path[:-1] == walked for path in step.tree_paths)
                for attempt in range(attempts[last.depth], siblings):
                    tried["sat", last.depth, attempt] += 1

    def rate(key) -> float:
        return passed[key] / tried[key] if tried[key] >= MIN_TRIES else 0.0

    sats = [key for key in tried if key[0] == "sat"]
    depth = max((key[1] for key in sats), default=0)
    rows = [[rate(("sat", d, i)) for i in range(1 + max(a for _, dd, a in sats if dd == d))]
            for d in range(1, depth + 1)]
    longest = max((key[1] for key in tried if key[0] == "copy"), default=0)
    return SampledAcceptance(temperature, top_p, rows, [rate(("copy", j)) for j in range(1, longest + 1)],
                             top_k=top_k, outputs=outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.acceptance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--subset", default="148-163", help="HumanEval problems (default 148-163)")
    which.add_argument("--prompts", metavar="FILE",
                       help="a prompt file (JSON lines, as the benchmark's) instead of HumanEval problems; chat "
                            "prompts get the chat template. A file of chat prompts alone is written to "
                            f"{CHAT_TRACE_FILE} (chat requests plan from it); name an --out for any other")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                        help="tokens of vanilla output per prompt (default 128)")
    parser.add_argument("--model", default=None, metavar="ID_OR_DIR",
                        help="hub id or local folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    parser.add_argument("--out", metavar="FILE",
                        help=f"where to write the trace (default: {TRACE_FILE} in the model's adapter folder, "
                             f"{CHAT_TRACE_FILE} for chat prompts)")
    parser.add_argument("--sampled-only", action="store_true",
                        help="keep the greedy trace in --out and measure the sampled acceptance again (default off)")
    args = parser.parse_args(argv)

    from ..config import DecodeConfig
    from ..engine import Engine
    from ..models import DEFAULT_MODEL, LoadConfig
    from .prompts import file_prompts, humaneval_prompts

    try:
        prompts = file_prompts(args.prompts) if args.prompts else humaneval_prompts(args.subset)
    except ValueError as err:  # PromptFileError among them
        parser.error(str(err))
    chat_only = bool(args.prompts) and all(p.kind == "chat" for p in prompts)
    if args.prompts and not chat_only and not args.out:  # before the model loads
        parser.error("--out is needed for prompts that are not all chat: the default traces are HumanEval's and chat's")
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(LoadConfig(model=args.model or DEFAULT_MODEL))
    if engine.sat_model.spec.adapter is None and not args.out:
        parser.error("--out is needed for a model whose SATs are not an adapter folder")
    out = Path(args.out or Path(engine.sat_model.spec.adapter) / (CHAT_TRACE_FILE if chat_only else TRACE_FILE))
    depth = engine.max_k
    which, flag = (args.prompts, f"--prompts {args.prompts}") if args.prompts else (
        f"HumanEval {args.subset}", f"--subset {args.subset}")
    source = (f"{which}, {engine.name}, greedy, {args.max_new_tokens} new tokens: "
              f"python -m sdsat.bench.acceptance {flag} --max-new-tokens {args.max_new_tokens}")
    if args.sampled_only:
        trace = Trace.load(out)
        kept = [p.prompt_ids for p in trace.prompts]
        if kept != [engine.encode(p.text, chat=p.kind == "chat") for p in prompts]:
            parser.error(f"--sampled-only: the prompts of {out} are not these ({which}); pass the prompts it was "
                         "measured on, or measure it whole")
    else:
        traces = []
        for prompt in prompts:
            chat = prompt.kind == "chat"
            ids = engine.encode(prompt.text, chat=chat)
            result = engine.generate(prompt.text, DecodeConfig(method="vanilla", max_new_tokens=args.max_new_tokens),
                                     chat=chat)
            ranks = ranks_along(engine.sat_model, ids, result.token_ids, depth)
            traces.append(PromptTrace(ids, result.token_ids, ranks))
            print(f"{prompt.name}: {len(result.token_ids)} tokens", file=sys.stderr)
        trace = Trace(traces, depth, source)
    trace.sampled = []
    for temperature, top_p, top_k in SAMPLED:
        trace.sampled.append(sampled_acceptance(engine, prompts, temperature, top_p, top_k, args.max_new_tokens))
        rates = {k: v for k, v in trace.sampled[-1].to_dict().items() if k != "outputs"}
        print(f"sampled T={temperature:g} top-p {top_p:g} top-k {top_k}: {rates}", file=sys.stderr)
    trace.save(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
