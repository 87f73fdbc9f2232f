"""`auto` settings: the SDSAT settings predicted to give the most tokens per second on this machine.

Two things decide it. The machine's cost curve (costs.py: what a pass over T tokens and a draft
pass cost, measured at load) and how often the SATs' drafts are right (an acceptance trace,
measured once per adapter and shipped with it: `python -m sdsat.bench.acceptance`). The trace holds,
for greedy decodes of held-out prompts, every output token and, at every position, the rank of the
true next tokens among each SAT's choices; and per sampling setting, pass rates and a sampled output
per prompt. Replaying the decoders' rules over it (prompt lookup from the real history, greedy or
sampled; the tree walk over the real ranks, or the measured pass rates) gives each candidate setting's tokens and
pass time per prompt; the planner takes the setting with the best median predicted speed-up over
the fastest vanilla decoding (which may run in another precision; a plan in a precision other than its
counts PRECISION_MARGIN lower). The choice is deterministic for a given curve and trace.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import SCHEMES
from .costs import CostCurve
from .drafters import LookupGate, leading_matches, lookup_continuation
from .tree import MAX_EXTRA, DraftTree

TRACE_FILE = "acceptance.json"
CHAT_TRACE_FILE = "acceptance-chat.json"  # chat prompts' trace, beside it where measured: chat requests plan from it
LOOKUP_TOKENS = 10  # copies verified per prompt-lookup iteration when auto turns lookup on
# auto without a plan (SATs without an acceptance trace, a machine not measured yet): the settings measured
# fastest on the AMD EPYC of docs/results.md; sampling without a plan drops the tree
FALLBACK = dict(k=3, lookup_tokens=10, tree_candidates=2)
LOOKUP_NGRAM = 2
MARGIN = 0.03  # predicted speed-ups this close count as a tie (see `choose`)
# A precision other than the fastest vanilla's counts its predicted speed-up this much lower (see `choose`)
PRECISION_MARGIN = 0.10
VOCABULARY = 1 << 16  # how many tokens "no top-k" counts as when sampling settings are compared
MISSED = 9  # a rank of this or above: the true token was not among the SAT's top choices kept


@dataclass
class PromptTrace:
    """One greedy decode: the prompt, vanilla's output, and per output position the SATs' ranks."""

    prompt_ids: list[int]
    output_ids: list[int]
    # ranks[n][d - 1]: at the draft pass fed output token n - 1 (the prompt's last token for n = 0), the rank of
    # output token n + d among SAT d's choices (0: its top choice; MISSED or above: not among the top ones kept)
    ranks: list[list[int]]
    _copies: dict = field(default_factory=dict, repr=False, compare=False)

    def copies(self, n: int, max_tokens: int) -> list[int]:
        """Prompt lookup's copies after the prompt and the first `n` output tokens (replays ask many times)."""
        key = (n, max_tokens)
        if key not in self._copies:
            history = self.prompt_ids + self.output_ids[:n]
            self._copies[key] = lookup_continuation(history, LOOKUP_NGRAM, max_tokens)
        return self._copies[key]


@dataclass
class SampledAcceptance:
    """How often sampled drafts pass the accept test at one sampling setting, measured over sampled decodes
    with the largest draft tree and prompt lookup (`python -m sdsat.bench.acceptance`)."""

    temperature: float
    top_p: float
    tries: list[list[float]]  # tries[d - 1][i]: the chance that the sibling tried (i + 1)-th at depth d passes,
    # given that it was tried (the earlier ones at that node having failed)
    copies: list[float]  # copies[j - 1]: the chance that copy j passes, given that copies 1..j - 1 did
    top_k: int = 0  # 0: no top-k
    # outputs[i]: the sampled output of the trace's prompt i at this setting, where the replay finds prompt
    # lookup's copies (sampled text repeats itself less than greedy text); empty in traces measured before
    outputs: list[list[int]] = field(default_factory=list)
    _texts: dict = field(default_factory=dict, repr=False, compare=False)

    def text(self, index: int, prompt: PromptTrace) -> PromptTrace:
        """Prompt `index` of the trace with this setting's sampled output, or `prompt` (greedy) if none was kept."""
        if not self.outputs:
            return prompt
        kept = self._texts.get(index)
        if kept is None or kept[0] is not prompt:
            kept = self._texts[index] = (prompt, PromptTrace(prompt.prompt_ids, self.outputs[index], []))
        return kept[1]

    def rate(self, depth: int, attempt: int) -> float:
        """tries[depth - 1][attempt], 0 where nothing was measured."""
        row = self.tries[depth - 1] if depth <= len(self.tries) else []
        return row[attempt] if attempt < len(row) else 0.0

    def expected_drafts(self, tree: DraftTree) -> float:
        """Expected accepted drafts of a verify pass over `tree`: at each node its children are tried in rank
        (draw) order, the i-th passing with rate(depth, i), and an accepted child's subtree is walked next."""
        def below(node: int, depth: int) -> float:
            reach, total = 1.0, 0.0
            for attempt, child in enumerate(tree.children.get(node, [])):
                passed = reach * self.rate(depth, attempt)
                total += passed * (1 + below(child, depth + 1))
                reach -= passed
            return total
        return below(-1, 1)

    def expected_copies(self, copies: int) -> float:
        """Expected accepted copies of `copies` verified as a chain."""
        chance, total = 1.0, 0.0
        for j in range(copies):
            chance *= self.copies[j] if j < len(self.copies) else 0.0
            total += chance
        return total

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "tries": [[round(r, 4) for r in row] for row in self.tries],
                "copies": [round(c, 4) for c in self.copies], "outputs": self.outputs}


@dataclass
class Trace:
    """Acceptance traces of one adapter (what `python -m sdsat.bench.acceptance` writes)."""

    prompts: list[PromptTrace]
    depth: int  # SATs measured per position
    source: str = ""  # which prompts, model and command
    sampled: list[SampledAcceptance] = field(default_factory=list)  # per sampling setting measured

    def save(self, path: Path) -> None:
        rows = [{"prompt_ids": p.prompt_ids, "output_ids": p.output_ids,
                 "ranks": ["".join(str(min(r, MISSED)) for r in row) for row in p.ranks]} for p in self.prompts]
        path.write_text(json.dumps({"depth": self.depth, "source": self.source, "prompts": rows,
                                    "sampled": [s.to_dict() for s in self.sampled]}) + "\n")

    @classmethod
    def load(cls, path: Path) -> "Trace":
        data = json.loads(Path(path).read_text())
        prompts = [PromptTrace(p["prompt_ids"], p["output_ids"], [[int(c) for c in row] for row in p["ranks"]])
                   for p in data["prompts"]]
        sampled = [SampledAcceptance(float(s["temperature"]), float(s["top_p"]), s["tries"], s["copies"],
                                     int(s.get("top_k", 0)), s.get("outputs", [])) for s in data.get("sampled", [])]
        for setting in sampled:  # output i is prompt i's: a trace whose counts differ cannot be replayed
            if setting.outputs and len(setting.outputs) != len(prompts):
                raise ValueError(f"acceptance trace {path}: the sampled setting T={setting.temperature:g} keeps "
                                 f"{len(setting.outputs)} outputs for {len(prompts)} prompts; measure it again")
        return cls(prompts, int(data["depth"]), data.get("source", ""), sampled)

    def sampled_at(self, temperature: float, top_p: float = 1.0, top_k: int = 0) -> SampledAcceptance | None:
        """The measured sampling setting nearest to (temperature, top_p, top_k), compared in that order (top-k
        by the log of the tokens it keeps, off counting as a whole vocabulary), or None when none was measured."""
        if not self.sampled:
            return None

        def kept(k: int) -> float:
            return math.log(k if k > 0 else VOCABULARY)

        return min(self.sampled, key=lambda s: (round(abs(s.temperature - temperature), 6),
                                                round(abs(s.top_p - top_p), 6), abs(kept(s.top_k) - kept(top_k))))


@dataclass(frozen=True)
class Settings:
    """The settings a plan chooses (DecodeConfig's fields of the same names)."""

    scheme: str = "two_step"
    k: int = 3
    lookup_tokens: int = 0
    tree_candidates: int = 0


@dataclass
class Prediction:
    """A setting's replay: predicted tokens per forward pass and speed-up (median over the trace's prompts)."""

    settings: Settings
    tokens_per_pass: float
    speedup: float  # against the fastest vanilla decoding
    speedup_same_numerics: float  # against vanilla in the curve's own precision


@dataclass
class Plan:
    """The chosen settings, why, and what the runner-ups were predicted to give."""

    settings: Settings
    predicted: Prediction
    dtype: str  # the precision the curve was measured in
    baseline: str  # the fastest vanilla decoding, e.g. "float32 vanilla, 38.1 ms per token"
    reason: str
    candidates: list[Prediction] = field(default_factory=list)  # the best few, best first

    def to_dict(self) -> dict:
        return {"settings": asdict(self.settings), "predicted_speedup": round(self.predicted.speedup, 3),
                "predicted_speedup_same_numerics": round(self.predicted.speedup_same_numerics, 3),
                "predicted_tokens_per_pass": round(self.predicted.tokens_per_pass, 3), "dtype": self.dtype,
                "baseline": self.baseline, "reason": self.reason,
                "candidates": [asdict(c.settings) | {"predicted_speedup": round(c.speedup, 3)}
                               for c in self.candidates]}


def _accepted(tree: DraftTree, ranks: list[int]) -> int:
    """Drafts a greedy verify pass over `tree` accepts when the true tokens have these ranks by depth."""
    node, accepted = -1, 0
    while accepted < len(ranks):  # a child of a node `accepted` deep is one deeper: its path's last rank decides
        node = next((c for c in tree.children.get(node, []) if tree.paths[c][-1] == ranks[accepted]), None)
        if node is None:
            break
        accepted += 1
    return accepted


def replay_sampled(trace: PromptTrace, settings: Settings, curve: CostCurve,
                   sampled: SampledAcceptance) -> tuple[int, int, float]:
    """Replay one decode under `settings` when sampling: where prompt lookup finds copies is read from
    `trace`'s text (a sampled output: `SampledAcceptance.text`), and each verify pass yields its expected
    accepted drafts or copies at `sampled`'s rates."""
    total, k, lookup = len(trace.output_ids), settings.k, settings.lookup_tokens
    tree = DraftTree.for_k(k, settings.tree_candidates)
    drafts, verify_s = sampled.expected_drafts(tree), curve.tree_s(k, settings.tree_candidates)
    n, passes, seconds = 0.0, 0, 0.0

    def copies(at: float) -> int:
        return len(trace.copies(int(at), lookup)[:total - int(at)]) if lookup and at < total else 0

    if settings.scheme == "fused":
        chain = sampled.expected_drafts(DraftTree.for_k(k, 0))
        iterations = max(0.0, (total - 1) / (chain + 1))
        return total, 1 + round(iterations), curve.draft_s(k) + iterations * curve.fused_s(k)
    gate = LookupGate(lookup, k)  # the decode's rules for its copies, on expected counts
    while n < total:
        width = copies(n) if n else 0
        if width and gate.pays(direct=True):  # lookup_direct
            width = min(width, gate.length())
            right = sampled.expected_copies(width)
            seconds, passes, n = seconds + curve.pass_s(1 + width), passes + 1, n + right + 1
            gate.saw_copies(right)
            continue
        unverified = (width, 2 + drafts) if width else None  # copies not verified, and the tokens they meet
        seconds, passes, n = seconds + curve.draft_s(k), passes + 1, n + 1
        if n >= total:
            break
        width = copies(n)
        if width and gate.pays(direct=False):  # lookup_after_draft
            width = min(width, gate.length())
            right = sampled.expected_copies(width)
            seconds, n = seconds + curve.pass_s(1 + width), n + right + 1
            gate.saw_copies(right)
        else:
            unverified = (width, 1 + drafts) if width else unverified
            seconds, n = seconds + verify_s, n + drafts + 1
            gate.saw_drafts(drafts)
            if unverified:
                gate.saw_copies(min(sampled.expected_copies(unverified[0]), unverified[1]))
        passes += 1
    return total, passes, seconds


def replay(trace: PromptTrace, settings: Settings, curve: CostCurve) -> tuple[int, int, float]:
    """Replay one decode under `settings`: (tokens produced, forward passes, predicted seconds)."""
    out, ranks, total = trace.output_ids, trace.ranks, len(trace.output_ids)
    k, lookup = settings.k, settings.lookup_tokens
    tree = DraftTree.for_k(k, settings.tree_candidates)
    verify_s = curve.tree_s(k, settings.tree_candidates)  # the same for every verify pass of the replay
    n = passes = 0
    seconds = 0.0

    def found(at: int) -> list[int]:
        """Prompt lookup's copies where the history ends at `at` (none past the output's end)."""
        return trace.copies(at, lookup)[:total - at] if lookup and at < total else []

    def verified(copies: list[int], at: int, length: int) -> tuple[int, int]:
        """(copies verified, copies right) of the first `length`."""
        shown = copies[:length]
        return len(shown), leading_matches(shown, out[at:at + len(shown)])

    if settings.scheme == "fused":
        # One draft pass, then passes that verify [start, k drafts] and anchor a run of k SATs after each of
        # those tokens ((k + 1)² positions, as verify.py builds them); the next drafts are the run's after the
        # accepted ones, through the head as a draft pass's, so the trace's ranks hold for them.
        seconds, passes, n = curve.draft_s(k), 1, 1
        while n < total:
            a = _accepted(DraftTree.for_k(k, 0), ranks[n - 1][:k]) if n - 1 < len(ranks) else 0
            seconds += curve.fused_s(k)
            passes += 1
            n += a + 1
        return total, passes, seconds
    gate = LookupGate(lookup, k)  # the decode's rules for its copies (drafters.PromptLookup)
    while n < total:
        copies = found(n) if n else []
        if copies and gate.pays(direct=True):  # lookup_direct: verify the copies at once, no draft pass
            width, right = verified(copies, n, gate.length())
            seconds += curve.pass_s(1 + width)
            passes += 1
            gate.saw_copies(right)
            n += right + 1
            continue
        unverified = (copies, n) if copies else None  # copies not verified, and where they start
        seconds += curve.draft_s(k)  # the draft pass: the sure token and k drafts
        passes += 1
        n += 1
        if n >= total:
            break
        copies = found(n)
        if copies and gate.pays(direct=False):  # lookup_after_draft
            width, right = verified(copies, n, gate.length())
            seconds += curve.pass_s(1 + width)
            gate.saw_copies(right)
            n += right + 1
        else:
            unverified = (copies, n) if copies else unverified
            a = _accepted(tree, ranks[n - 1][:k])
            seconds += verify_s
            gate.saw_drafts(a)
            if unverified:  # scored against the tokens this iteration gave from where they start
                gate.saw_copies(leading_matches(unverified[0], out[unverified[1]:n + a + 1]))
            n += a + 1
        passes += 1
    return total, passes, seconds


def candidates(max_k: int, greedy: bool = True, depth: int | None = None,
               schemes: tuple[str, ...] = SCHEMES) -> list[Settings]:
    """Every setting the planner weighs: the chain, trees and prompt lookup per k, and fused; `greedy` False
    (sampling with no sampled acceptance measured) leaves trees out, which the greedy replay cannot price."""
    top = min(max_k, depth or max_k)
    out = []
    for k in range(1, top + 1):
        if "fused" in schemes:
            out.append(Settings("fused", k))
        if "two_step" not in schemes:
            continue
        for lookup in (0, LOOKUP_TOKENS):
            for tree in range(0, (MAX_EXTRA if greedy else 0) + 1):
                if len(DraftTree.for_k(k, tree).paths) - k < tree:  # fewer runner-ups fit this depth
                    continue
                out.append(Settings("two_step", k, lookup, tree))
    return out


def _width(settings: Settings) -> int:
    """Positions of a setting's pass after a SAT draft: its verify pass, or the fused pass."""
    if settings.scheme == "fused":
        return (settings.k + 1) ** 2
    return 1 + len(DraftTree.for_k(settings.k, settings.tree_candidates).paths)


def predict(trace: Trace, settings: Settings, curve: CostCurve, baseline_s: float,
            sampled: SampledAcceptance | None = None) -> Prediction:
    """Median over prompts of the replayed speed-up against a vanilla decode at `baseline_s` per token; with
    `sampled`, the sampled replay at its rates."""
    ratios, same, tokens, passes = [], [], 0, 0
    for index, prompt in enumerate(trace.prompts):
        n, p, seconds = replay(prompt, settings, curve) if sampled is None else replay_sampled(
            sampled.text(index, prompt), settings, curve, sampled)
        ratios.append(n * baseline_s / seconds)
        same.append(n * curve.one_token_s / seconds)
        tokens, passes = tokens + n, passes + p
    return Prediction(settings, tokens / max(passes, 1), statistics.median(ratios), statistics.median(same))


def choose(curves: list[CostCurve], trace: Trace, max_k: int, greedy: bool = True,
           usable: set[str] | None = None, schemes: tuple[str, ...] = SCHEMES,
           baseline: tuple[str, float] | None = None, names: dict[str, str] | None = None,
           temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> Plan:
    """The setting and precision with the best predicted speed-up over the fastest vanilla decoding, a precision
    other than that vanilla's ranked by its speed-up less PRECISION_MARGIN, ties (MARGIN) broken as commented below.

    `usable`: the precisions SDSAT may decode in (tuning.py's rule); `baseline`: the fastest vanilla
    decoding as (name, seconds per token), by default the fastest one-token pass among `curves`, usable
    or not; `names`: how the reason names each precision (e.g. with its kernel form). Sampling (`greedy`
    False) at `temperature`, `top_p` and `top_k` replays at the trace's nearest measured sampled acceptance, trees
    included; a trace without one replays greedily, without trees.
    """
    sampled = None if greedy else trace.sampled_at(temperature, top_p, top_k)
    names = names or {}
    if baseline is None:
        fastest = min(curves, key=lambda c: c.one_token_s)
        baseline = (names.get(fastest.dtype, fastest.dtype), fastest.one_token_s)
    baseline_text = f"{baseline[0]} vanilla, {baseline[1] * 1e3:.1f} ms per token"
    scored = []
    for curve in curves:
        if usable is not None and curve.dtype not in usable:
            continue
        for settings in candidates(max_k, greedy or sampled is not None, trace.depth, schemes):
            scored.append((predict(trace, settings, curve, baseline[1], sampled), curve.dtype))
    if not scored:
        raise ValueError("no precision is usable for SDSAT on this machine")
    # Best predicted speed-up, and among the settings predicted within MARGIN of it the narrowest (fewest
    # positions per verify pass), then the two-step scheme before fused, then the smallest k: the replay prices
    # passes from a curve measured at one context length, and wide passes and fused ones were those it underpriced.
    # A precision other than the fastest vanilla's is ranked by its speed-up less PRECISION_MARGIN: its curve is
    # measured apart from the baseline's, and its greedy output is another text than the trace's replay assumes.
    baseline_dtype = baseline[0].split()[0]

    def ranked(s: tuple[Prediction, str]) -> float:
        return s[0].speedup if s[1] == baseline_dtype else s[0].speedup / (1 + PRECISION_MARGIN)

    scored.sort(key=lambda s: (-round(ranked(s), 6), s[0].settings.k, s[0].settings.tree_candidates))
    top = ranked(scored[0])
    close = [s for s in scored if ranked(s) >= top * (1 - MARGIN)]
    best, dtype = min(close, key=lambda s: (_width(s[0].settings), s[0].settings.scheme != "two_step",
                                            s[0].settings.k, s[1] != baseline_dtype, -ranked(s)))
    scored.remove((best, dtype))
    scored.insert(0, (best, dtype))
    s = best.settings
    what = (f"{s.scheme} k={s.k}" + (f", prompt lookup {s.lookup_tokens}" if s.lookup_tokens else "")
            + (f", draft tree +{s.tree_candidates}" if s.tree_candidates else ""))
    where = names.get(dtype, dtype)
    if sampled is not None:
        what += (f", sampling at T={sampled.temperature:g}" + (f" top-p {sampled.top_p:g}" if sampled.top_p < 1 else "")
                 + (f" top-k {sampled.top_k}" if sampled.top_k else ""))
    if best.speedup > 1:
        reason = (f"{what} in {where}: predicted {best.speedup:.2f}× the fastest vanilla ({baseline_text}), "
                  f"{best.tokens_per_pass:.2f} tokens per pass")
    else:
        reason = (f"no setting is predicted to beat vanilla on this machine; the closest is {what} in {where} at "
                  f"{best.speedup:.2f}× ({baseline_text})")
    return Plan(s, best, dtype, baseline_text, reason, [p for p, _ in scored[:5]])
