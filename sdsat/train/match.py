"""`python -m sdsat.train.match`: fit the sampler head's match term along vanilla's outputs.

The match term (sdsat/head.py) scores each candidate by the longest run of the text's last tokens that it followed
earlier, one weight m_j per SAT position, added after everything else the head computes. With the rest of the head
fixed, the weights are few and the objective is the one decoding has: each m_j is chosen from a grid, SAT position
by position and twice over, to maximise the expected accepted drafts of greedy verification (drafts 1..k
cumulative, `python -m sdsat.bench.drafts`'s count) along vanilla's greedy outputs of tuning prompts: by default
the adapter's own acceptance traces (acceptance.json and acceptance-chat.json: HumanEval 148-163 and the 16 chat
prompts the planner replays, apart from every suite the results are judged on), or results files of
`python -m sdsat.bench`.

Writes a copy of the adapter folder with the head's match term on and its record beside it (`match` in
sampler_head_record.json), ready for `python -m sdsat.bench.drafts` and `python -m sdsat.bench --adapter`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from ..sat import SatModel

GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)
SWEEPS = 2


def trace_outputs(path: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) of an acceptance trace's prompts (`python -m sdsat.bench.acceptance`)."""
    try:
        prompts = json.loads(Path(path).read_text())["prompts"]
        return [(p["prompt_ids"], p["output_ids"]) for p in prompts]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"traces: {path} is not an acceptance trace with outputs ({err})") from err


def rows_along(sat_model: SatModel, runs: list[tuple[list[int], list[int]]], k: int) -> list[dict[str, torch.Tensor]]:
    """Per output (of more than k tokens): the head's scores of each SAT row's candidates without the match term,
    the candidates' longest matches, the true tokens and the rows' slots, as the drafts benchmark reads them (on
    the CPU, where the fit's weights are)."""
    from ..bench.drafts import draft_prev_positions, logits_along
    from ..head import match_lengths

    head, model = sat_model.sampler, sat_model.model
    embed_in, embed_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    matching, head.config.match = head.config.match, False
    rows = []
    try:
        for prompt_ids, output_ids in runs:
            if len(output_ids) <= k:
                continue
            _, z, sats, slot = logits_along(sat_model, prompt_ids, output_ids, k)
            tokens = torch.tensor(prompt_ids + output_ids, device=sat_model.device)
            where = draft_prev_positions(len(prompt_ids), len(output_ids) - k, k, slot)
            with torch.inference_mode():
                cand, scores = head.candidates(sats, z, tokens[where], slot, embed_in, embed_out, tokens, where)
                row = {"cand": cand, "scores": scores, "lengths": match_lengths(tokens, where, cand),
                       "truth": tokens[where + 1], "slot": slot}
            rows.append({name: value.cpu() for name, value in row.items()})
    finally:
        head.config.match = matching
    return rows


def expected_drafts(rows: list[dict[str, torch.Tensor]], weights: torch.Tensor, k: int) -> list[float]:
    """Drafts 1..k accepted (cumulative, greedy) with match weights `weights` (num_sats,) over `rows`."""
    from ..bench.drafts import cumulative_acceptance
    from ..head import match_feature

    misses = []
    for row in rows:
        slot = row["slot"].clamp(max=len(weights) - 1)
        scores = row["scores"] + weights[slot][:, None] * match_feature(row["lengths"])
        pick = row["cand"].gather(1, scores.argmax(1, keepdim=True))[:, 0]
        misses.append(pick.ne(row["truth"]).long().view(-1, k))
    return cumulative_acceptance(torch.cat(misses).tolist() if misses else [], k)[0]


def fit(num_sats: int, suites: dict[str, list[dict[str, torch.Tensor]]], k: int,
        grid: tuple[float, ...] = GRID, sweeps: int = SWEEPS) -> tuple[torch.Tensor, list[dict]]:
    """Coordinate search of the match weights over `grid`, SAT positions 1..k in turn, `sweeps` times; positions
    after k share the k-th weight. The objective is the expected drafts per pass summed over the suites (each suite
    counts alike, whatever its size). Returns the weights (num_sats,) and the search's record (one entry a sweep)."""
    weights, record = torch.zeros(num_sats), []

    def total(w: torch.Tensor) -> float:
        return sum(sum(expected_drafts(rows, w, k)) for rows in suites.values())

    for sweep in range(sweeps):
        for j in range(min(k, len(weights))):
            tried = []
            for value in grid:
                w = weights.clone()
                w[j:j + 1 if j < k - 1 else None] = value
                tried.append((total(w), -abs(value), value))  # ties: the smaller weight
            weights[j:j + 1 if j < k - 1 else None] = max(tried)[2]
        record.append({"sweep": sweep + 1, "weights": [round(float(w), 4) for w in weights],
                       "expected_drafts_summed_over_suites": round(total(weights), 4)})
    return weights, record


def main(argv: list[str] | None = None) -> int:
    from ..cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.train.match", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter", metavar="ADAPTER_DIR", help="a SAT adapter folder with a sampler head beside it")
    parser.add_argument("--traces", nargs="*", default=None, metavar="TRACE_JSON",
                        help="acceptance traces (`python -m sdsat.bench.acceptance`) whose outputs the fit reads "
                             "(default: the adapter's acceptance.json and acceptance-chat.json)")
    parser.add_argument("--outputs-from", nargs="*", default=[], metavar="RESULTS_JSON",
                        help="also `python -m sdsat.bench` results files whose greedy vanilla outputs the fit reads")
    parser.add_argument("--out", required=True, help="folder for the adapter with the fitted head")
    parser.add_argument("--k", type=int, default=3, help="drafts per pass (default 3)")
    parser.add_argument("--dtype", default="float32", help="precision of the model (default float32)")
    parser.add_argument("--model", default=None, metavar="ID_OR_DIR", help="base model (default: the embedded one)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    adapter, out = Path(args.adapter), Path(args.out)
    if not (adapter / "sampler_head.json").is_file():
        raise ValueError(f"adapter must be a folder with a sampler head beside it (no sampler_head.json in {adapter})")
    if out.resolve() == adapter.resolve():
        raise ValueError("out must be a new folder, not the adapter's own")
    if args.k < 1:
        raise ValueError(f"k must be at least 1, got {args.k}")
    traces = [adapter / name for name in ("acceptance.json", "acceptance-chat.json")
              if (adapter / name).is_file()] if args.traces is None else [Path(t) for t in args.traces]
    if not traces and not args.outputs_from:
        raise ValueError("the fit needs outputs to read: give --traces or --outputs-from")

    from ..bench.drafts import outputs_from
    from ..engine import Engine
    from ..hardware import describe
    from ..models import DEFAULT_MODEL, LoadConfig
    from ..sat import SatAdapter, SatSpec

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(LoadConfig(model=args.model or DEFAULT_MODEL, dtype=args.dtype, measure_kernels=False))
    sat_model = SatModel(engine.sat_model.model, SatSpec(kind="adapter", max_k=args.k, adapter=str(adapter)),
                         SatAdapter.load(adapter))
    if sat_model.adapter.config.num_sats < args.k:
        raise ValueError(f"k must be at most the adapter's {sat_model.adapter.config.num_sats} SATs; got {args.k}")
    machine = describe(engine.sat_model.model)
    try:
        runs = {trace.stem: trace_outputs(trace) for trace in traces}
        runs |= {name: suite["greedy"] for name, suite in outputs_from(engine, args.outputs_from, []).items()}
        suites = {name: rows_along(sat_model, outputs, args.k) for name, outputs in runs.items()}
        head = sat_model.sampler
        before = {name: expected_drafts(rows, torch.zeros(head.config.num_sats), args.k)
                  for name, rows in suites.items()}
        weights, search = fit(head.config.num_sats, suites, args.k)
        after = {name: expected_drafts(rows, weights, args.k) for name, rows in suites.items()}
    finally:
        sat_model.adapter.detach()
    shutil.copytree(adapter, out, dirs_exist_ok=True)
    with torch.no_grad():
        head.match_weight.copy_(weights)
    head.config.match = True
    head.save(out)
    record_file = out / "sampler_head_record.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    record["match"] = {
        "command": "python -m sdsat.train.match " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine, "k": args.k, "grid": list(GRID), "search": search,
        "weights": [round(float(w), 4) for w in weights],
        "tuning_suites": {name: {"before": [round(a, 4) for a in before[name]],
                                 "after": [round(a, 4) for a in after[name]]} for name in suites}}
    record_file.write_text(json.dumps(record, indent=1) + "\n")
    for name in suites:
        print(f"{name}: drafts 1..{args.k} " + " / ".join(f"{a:.3f}" for a in before[name]) + " -> "
              + " / ".join(f"{a:.3f}" for a in after[name]))
    print("match weights per SAT position: " + ", ".join(f"{float(w):g}" for w in weights) + f"; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
