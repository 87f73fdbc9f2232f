"""`python -m sdsat.bench.drafts`: how often each set of SATs would be accepted in decoding.

Greedy: for each prompt, vanilla's greedy output is decoded once; then, for each adapter, a draft pass at
every output position over the true history tells whether SAT j's first choice is the token greedy
decoding puts j places after the pass's own token. Draft j counts as accepted where it and every draft
before it match, as greedy verification decides. The draft passes of a prompt run as one pass, a run of
SATs after each position under the training's mask (`along`): the decoder's own draft pass, one position
at a time (`acceptance.ranks_along`), agrees with it (tested) at a tenth of the speed.

Sampled (`--sampled T,TOP_P`): along vanilla's sampled output with those settings, SAT j's draft would pass
its accept test with probability sum_x min(p(x), q(x)) (p: the model's distribution for that token, q:
SAT j's, both warped), given the history up to it is the one sampled. The table gives that rate per SAT,
and the mean over positions of its product over SATs 1..j, which is how often a chain's first j drafts
pass where the draft pass sees that history.

An adapter folder with a sampler head beside it (head.py) drafts through the head: SAT j conditioned on the
output token before the one it drafts (`along_head`), which is what decoding feeds it wherever drafts
1..j - 1 were accepted; q is the head's distribution.

This is acceptance in decoding, not on training text, and it compares adapters on the same outputs at a
draft pass per position: what a learning curve needs. Speed is the benchmark's job
(`python -m sdsat.bench --adapter DIR`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def cumulative_acceptance(ranks: list[list[int]], k: int) -> tuple[list[float], int]:
    """Per draft position j = 1..k, the share of draft passes whose drafts 1..j all match (rank 0), over the
    passes with all k drafts inside the output; and the number of those passes."""
    rows = [row[:k] for row in ranks if len(row) >= k]
    if not rows:
        return [0.0] * k, 0
    accepted = [0] * k
    for row in rows:
        for j in range(k):
            if row[j] != 0:
                break
            accepted[j] += 1
    return [a / len(rows) for a in accepted], len(rows)


def along(sat_model, prompt_ids: list[int], output_ids: list[int], k: int) -> tuple[torch.Tensor, ...]:
    """One pass over prompt + output with a run of k SATs after every position whose k drafts fall inside the
    output (the draft pass fed that position's token), as in training (`sat_logits`): the model's logits
    for the tokens the drafts stand for (R, k, V), the SATs' logits (R, k, V) and those tokens (R, k)."""
    from ..layout import SatLayout
    from ..train.trainer import sat_logits

    seq, runs = prompt_ids + output_ids, len(output_ids) - k
    layout = SatLayout.runs_at(len(seq), torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + runs), k)
    with torch.inference_mode():
        teacher, student = sat_logits(sat_model, torch.tensor([seq], device=sat_model.device), layout,
                                      layout.target_positions, frozen_base=True)
    truth = torch.tensor(seq)[layout.target_positions + 1].to(student.device)
    return teacher.view(runs, k, -1), student.view(runs, k, -1), truth.view(runs, k)


def along_head(sat_model, prompt_ids: list[int], output_ids: list[int], k: int) -> tuple[torch.Tensor, ...]:
    """`along` through the final hidden states, and through the sampler head where the adapter has one
    (head.py): SAT j is then conditioned on the output token before the one it drafts (t for SAT 1), which is
    draft j - 1 wherever drafts 1..j - 1 were accepted. Same shapes as `along`."""
    return _through_head(sat_model, logits_along(sat_model, prompt_ids, output_ids, k), prompt_ids, output_ids, k)


def along_heads(models: dict, prompt_ids: list[int], output_ids: list[int], k: int) -> dict:
    """{folder: `along`'s (teacher, student, truth)} for SatModels on adapter folders; those whose adapter weights
    are one file share its SAT pass and logits, and a sampler head beside a folder drafts (`along_head`)."""
    results, shared = {}, {}
    for folder, sat_model in models.items():
        if not sat_model.plain_head:
            results[folder] = along(sat_model, prompt_ids, output_ids, k)
            continue
        folder_of = sat_model.spec.adapter
        key = (Path(folder_of) / "adapter_model.safetensors").resolve() if folder_of else id(sat_model.adapter)
        if key not in shared:
            shared[key] = logits_along(sat_model, prompt_ids, output_ids, k)
        results[folder] = _through_head(sat_model, shared[key], prompt_ids, output_ids, k)
    return results


def logits_along(sat_model, prompt_ids, output_ids, k) -> tuple[torch.Tensor, ...]:
    """The standard rows' logits (R k, V) at the positions the SATs stand for, the SATs' own logits (R k, V),
    their final hidden states (R k, H) and slots (R k,): what a sampler head re-ranks (`along_head`)."""
    standard, sats, slot = _states_along(sat_model, prompt_ids, output_ids, k)
    with torch.inference_mode():
        return sat_model.head(standard), sat_model.head(sats), sats, slot


def draft_prev_positions(prompt_len: int, runs: int, k: int, slot: torch.Tensor) -> torch.Tensor:
    """(R k,) where the token before each SAT row's draft stands in prompt + output: run r's pass follows output
    position r (t is the output token there) and SAT j + 1 drafts the token after position r + j (slot j)."""
    return torch.arange(prompt_len, prompt_len + runs, device=slot.device).repeat_interleave(k) + slot


def _through_head(sat_model, logits: tuple[torch.Tensor, ...], prompt_ids, output_ids, k) -> tuple[torch.Tensor, ...]:
    teacher, z, sats, slot = logits
    runs, model, device = len(output_ids) - k, sat_model.model, sat_model.device
    tokens = torch.tensor(prompt_ids + output_ids, device=device)
    where = draft_prev_positions(len(prompt_ids), runs, k, slot)
    with torch.inference_mode():
        student = z if sat_model.sampler is None else sat_model.sampler.logits(
            sats, z, tokens[where], slot, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
            tokens, where)
    return teacher.view(runs, k, -1), student.view(runs, k, -1), tokens[where + 1].view(runs, k)


def _states_along(sat_model, prompt_ids: list[int], output_ids: list[int], k: int) -> tuple[torch.Tensor, ...]:
    """The final hidden states `along_head` reads: at the positions the SATs stand for (R k, H), of the SATs
    (R k, H), and each SAT's slot (R k,)."""
    from transformers import DynamicCache

    from ..layout import SatLayout

    seq, runs = prompt_ids + output_ids, len(output_ids) - k
    n, device = len(seq), sat_model.device
    layout = SatLayout.runs_at(n, torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + runs), k)
    mask, positions = layout.attention_mask().to(device), layout.position_ids.to(device)
    with torch.inference_mode():
        cache = DynamicCache(config=sat_model.model.config)
        standard = sat_model.hidden_states(torch.tensor([seq], device=device), cache=cache,
                                           attention_mask=mask[..., :n, :n], position_ids=positions[:, :n])[0]
        sats = sat_model.hidden_states(torch.zeros(1, layout.num_sats, dtype=torch.long, device=device),
                                       layout.sat_slots.to(device)[:, n:], cache=cache,
                                       attention_mask=mask[..., n:, :], position_ids=positions[:, n:])[0]
    return standard[layout.target_positions.to(device)], sats, layout.slot.to(device)


def measure(engine, adapters: list[Path], suites: dict[str, list], k: int, max_new_tokens: int,
            sampled: tuple[tuple[float, float], ...] = (), log=lambda line: None, given: dict | None = None) -> dict:
    """{suite: {"passes": n, "acceptance": {adapter: [draft 1..k]}, "sampled T,top_p": {"passes": n,
    "pass_rate": {adapter: [SAT 1..k]}, "acceptance": {adapter: [drafts 1..k]}}}} over each suite's prompts.
    `given` ({suite: {"greedy" or "sampled T,top_p": [(prompt ids, output ids)]}}) supplies vanilla's outputs of
    those suites (`outputs_from`), which are then not decoded again."""
    from ..config import DecodeConfig
    from ..decoding import collect
    from ..sampling import SamplingConfig, TokenChooser
    from ..sat import SatAdapter, SatModel, SatSpec

    base = engine.sat_model
    settings = [(f"sampled {t:g},{p:g}", SamplingConfig(do_sample=True, temperature=t, top_p=p, seed=0))
                for t, p in sampled]
    outputs = dict(given or {})
    for name, prompts in suites.items():
        if name in outputs:
            continue
        outputs[name] = {"greedy": []} | {label: [] for label, _ in settings}
        for i, prompt in enumerate(prompts):
            ids = engine.encode(prompt.text, chat=prompt.kind == "chat")
            greedy = DecodeConfig(method="vanilla", max_new_tokens=max_new_tokens)
            outputs[name]["greedy"].append((ids, collect(engine.stream(ids, greedy)).token_ids))
            for label, sampling in settings:
                config = DecodeConfig(method="vanilla", max_new_tokens=max_new_tokens,
                                      sampling=SamplingConfig(**{**vars(sampling), "seed": i}))
                outputs[name][label].append((ids, collect(engine.stream(ids, config)).token_ids))
        log(f"{name}: vanilla output of {len(prompts)} prompts")
    results = {name: {"passes": 0, "acceptance": {}} | {label: {"passes": 0, "pass_rate": {}, "acceptance": {}}
                                                         for label, _ in settings if label in outputs[name]}
               for name in outputs}
    models = {}
    for folder in adapters:
        adapter = SatAdapter.load(folder)
        if adapter.config.num_sats < k:
            raise ValueError(f"k must be at most the adapter's {adapter.config.num_sats} SATs ({folder}); got {k}")
        models[str(folder)] = SatModel(base.model, SatSpec(kind="adapter", max_k=k, adapter=str(folder)), adapter)
    try:
        for name, runs in outputs.items():
            # Prompt by prompt, every adapter: folders that share adapter weights (heads on one adapter) share the
            # SAT pass and the projections onto the vocabulary (`along_heads`).
            matches = {folder: [] for folder in models}
            for ids, out in runs["greedy"]:
                if len(out) > k:
                    for folder, (_, student, truth) in along_heads(models, ids, out, k).items():
                        matches[folder].append((student.argmax(-1) == truth).long())
            for folder, rows in matches.items():
                misses = torch.cat(rows).ne(1).long().tolist() if rows else []  # every output ended early
                acceptance, passes = cumulative_acceptance(misses, k)
                results[name]["passes"] = passes
                results[name]["acceptance"][folder] = [round(a, 4) for a in acceptance]
                log(f"{folder} {name}: " + " / ".join(f"{a:.2f}" for a in acceptance))
            for label, sampling in settings:
                if label not in runs:
                    continue
                chooser = TokenChooser(sampling, base.device)
                warped = lambda logits: chooser.probs(logits.flatten(0, 1)).view(logits.shape)  # noqa: E731
                rates = {folder: [torch.zeros(0, k, device=base.device)] for folder in models}
                for ids, out in runs[label]:
                    if len(out) > k:
                        for folder, (teacher, student, _) in along_heads(models, ids, out, k).items():
                            rates[folder].append(torch.minimum(warped(teacher), warped(student)).sum(-1))
                entry = results[name][label]
                for folder, rows in rates.items():
                    rate = torch.cat(rows)
                    entry["passes"] = len(rate)
                    entry["pass_rate"][folder] = [round(float(a), 4) for a in rate.mean(0).nan_to_num()]
                    entry["acceptance"][folder] = [round(float(a), 4) for a in rate.cumprod(-1).mean(0).nan_to_num()]
                    log(f"{folder} {name} {label}: " + " / ".join(f"{a:.2f}" for a in entry["acceptance"][folder]))
    finally:
        for sat_model in models.values():
            sat_model.adapter.detach()
    return results


def draft_pass_cost(engine, adapters: list[Path], k: int, context: int = 256, repeats: int = 30,
                    seed: int = 0) -> dict:
    """Median seconds of a one-token pass and of each adapter's draft pass [c, SAT x k] (with its sampler head's
    k drafts where it has one), interleaved round by round on a cache of `context` tokens, and each draft pass
    relative to the one-token pass: {"one_token_s": s, "draft_s": {adapter: s}, "relative": {adapter: x}}."""
    import statistics

    from transformers import DynamicCache

    from ..drafters import DraftContext, conditioned_draft_pass
    from ..kvcache import rollback
    from ..sampling import SamplingConfig, TokenChooser
    from ..sat import SatAdapter, SatModel, SatSpec
    from ..timing import Clock

    model = engine.sat_model.model
    models = {str(folder): SatModel(model, SatSpec(kind="adapter", max_k=k, adapter=str(folder)),
                                    SatAdapter.load(folder)) for folder in adapters}
    gen = torch.Generator().manual_seed(seed)
    vocab, device = model.get_input_embeddings().weight.shape[0], engine.sat_model.device
    cache = DynamicCache(config=model.config)
    chooser = TokenChooser(SamplingConfig(), device)
    times = {"one": []} | {name: [] for name in models}
    try:
        with torch.inference_mode():
            engine.sat_model.forward(torch.randint(0, vocab, (1, context), generator=gen).to(device), cache=cache,
                                     logits_to_keep=1)
            for _ in range(repeats + 1):  # the first round warms up and is dropped
                token = int(torch.randint(0, vocab, (1,), generator=gen))
                clock = Clock(device)
                start = clock.now()
                engine.sat_model.forward(torch.tensor([[token]], device=device), cache=cache, logits_to_keep=1)
                times["one"].append(clock.now() - start)
                rollback(cache, context)
                for name, sat_model in models.items():
                    ctx = DraftContext(sat_model, chooser, cache, [token], [token], k, clock)
                    times[name].append(conditioned_draft_pass(ctx, k)[-1])
                    rollback(cache, context)
    finally:
        for sat_model in models.values():
            sat_model.adapter.detach()
    one = statistics.median(times.pop("one")[1:])
    draft = {name: statistics.median(values[1:]) for name, values in times.items()}
    return {"one_token_s": one, "draft_s": draft, "relative": {name: round(s / one, 3) for name, s in draft.items()}}


def outputs_from(engine, files: list[str], sampled: list[tuple[float, float]]) -> dict:
    """Vanilla's outputs from `python -m sdsat.bench` results files, one suite each (named by its folder): per
    prompt the first greedy vanilla run, and for each sampled setting the first vanilla_sample run at that
    temperature and top-p. Shapes as `measure`'s `given`; a file without greedy vanilla runs is a ValueError."""
    given = {}
    for file in files:
        data = json.loads(Path(file).read_text())
        top_p = data.get("meta", {}).get("settings", {}).get("top_p")
        suite = {"greedy": []} | {f"sampled {t:g},{p:g}": [] for t, p in sampled}
        for prompt in data["prompts"]:
            runs = [r for r in data["runs"] if int(r["prompt_index"]) == prompt["index"]]
            ids = engine.encode(prompt["text"], chat=prompt["kind"] == "chat")
            greedy = [r for r in runs if r["method"] == "vanilla"]
            if greedy:
                suite["greedy"].append((ids, greedy[0]["token_ids"]))
            for t, p in sampled:
                drawn = [r for r in runs if r["method"] == "vanilla_sample" and r["temperature"] == t
                         and (top_p is None or abs(float(top_p) - p) < 1e-9)]
                if drawn:
                    suite[f"sampled {t:g},{p:g}"].append((ids, drawn[0]["token_ids"]))
        if not suite["greedy"]:
            raise ValueError(f"{file} has no greedy vanilla runs to measure drafts along")
        given[Path(file).parent.name] = {label: runs for label, runs in suite.items() if runs}
    return given


def sampling_settings(values: list[str]) -> list[tuple[float, float]]:
    """`--sampled` values "T,TOP_P" -> [(temperature, top_p)]; a bad one is a ValueError naming it."""
    from ..sampling import SamplingConfig

    settings = []
    for setting in values:
        try:
            temperature, top_p = (float(x) for x in setting.split(","))
        except ValueError:
            raise ValueError(f"sampled must be T,TOP_P pairs such as 0.7,0.95; got {setting!r}") from None
        SamplingConfig(do_sample=True, temperature=temperature, top_p=top_p).validate()  # names a bad value
        settings.append((temperature, top_p))
    return settings


def main(argv: list[str] | None = None) -> int:
    from ..cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdsat.bench.drafts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapters", nargs="+", metavar="ADAPTER_DIR", help="SAT adapter folders to compare")
    parser.add_argument("--humaneval", default="16-35", metavar="SPEC",
                        help='HumanEval problems ("" for none; default 16-35, held out from the acceptance trace)')
    parser.add_argument("--prompts", nargs="*", default=["assets/prompts/heldout_code.jsonl",
                                                         "assets/prompts/heldout_chat.jsonl"], metavar="FILE",
                        help="prompt files, one suite each (default: the held-out code and chat prompts)")
    parser.add_argument("--k", type=int, default=3, help="drafts per pass (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="vanilla tokens per prompt")
    parser.add_argument("--sampled", nargs="*", default=[], metavar="T,TOP_P",
                        help="also sampled acceptance at these settings, e.g. 0.7,0.95 1,1 (default: greedy only)")
    parser.add_argument("--dtype", default="bfloat16", help="precision of the model (default bfloat16)")
    parser.add_argument("--model", default=None, metavar="ID_OR_DIR", help="base model (default: the embedded one)")
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default: torch's choice)")
    parser.add_argument("--outputs-from", nargs="*", default=[], metavar="RESULTS_JSON",
                        help="also suites whose vanilla outputs are read from these `python -m sdsat.bench` results "
                             "files instead of decoded (one suite each, named by its folder)")
    parser.add_argument("--pass-cost", type=int, default=0, metavar="REPEATS",
                        help="only time each adapter's draft pass (its head's drafts included) against a one-token "
                             "pass, this many interleaved rounds, and skip acceptance")
    parser.add_argument("--out", metavar="FILE", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    for name, value, low in (("k", args.k, 1), ("max_new_tokens", args.max_new_tokens, args.k + 1)):
        if value < low:
            raise ValueError(f"{name} must be at least {low}" + (" (more than k)" if name != "k" else "")
                             + f", got {value}")
    sampled = sampling_settings(args.sampled)
    adapters = [Path(a) for a in args.adapters]
    for folder in adapters:
        if not (folder / "adapter_config.json").is_file():
            raise ValueError(f"{folder} is not a SAT adapter folder (no adapter_config.json)")
        sats = json.loads((folder / "adapter_config.json").read_text()).get("num_sats", 0)
        if sats < args.k:
            raise ValueError(f"k must be at most the adapter's {sats} SATs ({folder}); got {args.k}")

    from ..engine import Engine
    from ..models import DEFAULT_MODEL, LoadConfig
    from .prompts import file_prompts, humaneval_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.pass_cost:
        engine = Engine.load(LoadConfig(model=args.model or DEFAULT_MODEL, dtype=args.dtype, measure_kernels=False))
        cost = draft_pass_cost(engine, adapters, args.k, repeats=args.pass_cost)
        command = "python -m sdsat.bench.drafts " + " ".join(argv if argv is not None else sys.argv[1:])
        if args.out:
            Path(args.out).write_text(json.dumps({"command": command, "dtype": args.dtype, **cost}, indent=1) + "\n")
        print(f"one-token pass {cost['one_token_s'] * 1e3:.1f} ms; draft pass [c, SAT x {args.k}] relative to it:")
        for folder, relative in cost["relative"].items():
            print(f"  {folder}  {cost['draft_s'][folder] * 1e3:.1f} ms  {relative:.2f}x")
        return 0
    suites = {f"HumanEval {args.humaneval}": humaneval_prompts(args.humaneval)} if args.humaneval else {}
    suites.update({Path(p).stem: file_prompts(p) for p in args.prompts})
    engine = Engine.load(LoadConfig(model=args.model or DEFAULT_MODEL, dtype=args.dtype, measure_kernels=False))
    given = outputs_from(engine, args.outputs_from, sampled)
    results = measure(engine, adapters, suites, args.k, args.max_new_tokens, tuple(sampled),
                      log=lambda line: print(line, file=sys.stderr, flush=True), given=given)
    command = "python -m sdsat.bench.drafts " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"command": command, "k": args.k, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
              "suites": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    width = max(len(str(a)) for a in adapters)
    for name, suite in results.items():
        print(f"{name} ({suite['passes']} draft passes): cumulative acceptance of drafts 1..{args.k}")
        for folder, acceptance in suite["acceptance"].items():
            print(f"  {folder:<{width}}  " + " / ".join(f"{a:.2f}" for a in acceptance)
                  + f"   (expected drafts {sum(acceptance):.2f})")
        for label in (key for key in suite if key.startswith("sampled")):
            print(f"  {label} ({suite[label]['passes']} positions): pass rate per SAT | drafts 1..{args.k} passing")
            for folder, rate in suite[label]["pass_rate"].items():
                chain = suite[label]["acceptance"][folder]
                print(f"  {folder:<{width}}  " + " / ".join(f"{a:.2f}" for a in rate) + "  |  "
                      + " / ".join(f"{a:.2f}" for a in chain) + f"   (expected drafts {sum(chain):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
