"""The numbers above the race: tokens/s, speed-up, tokens per iteration and per pass, the lossless check."""

from __future__ import annotations

from .race import RaceRecord, RaceSnapshot
from .render import esc


def _card(value: str, label: str, note: str = "", cls: str = "") -> str:
    note = f'<div class="note">{note}</div>' if note else ""
    return f'<div class="card {cls}"><div class="value">{value}</div><div class="label">{label}</div>{note}</div>'


def sat_badge(trained: bool) -> str:
    if trained:
        return '<span class="badge ok">SAT adapter: trained</span>'
    return ('<span class="badge warn" title="Until the trained adapter is installed, drafts are rarely accepted, so '
            'SDSAT cannot beat vanilla by much. Outputs are still identical.">'
            'SAT adapter: untrained (low acceptance expected)</span>')


def check_html(record: RaceRecord) -> str:
    """The lossless check for greedy runs; sampling runs say why their texts differ."""
    if not record.greedy:
        return ('<div class="check info">Sampling: the two texts differ by design. Both sample from the same '
                'distribution — SDSAT verifies drafts with speculative sampling (accept with min(1, p/q)), which '
                'provably leaves the output distribution unchanged.</div>')
    same, n = record.identical()
    partial = "" if len(record.vanilla.token_ids) == len(record.sdsat.token_ids) else \
        f" (one decoder hit the time limit, so the first {n} tokens were compared)"
    if same:
        return (f'<div class="check ok">✓ Identical output: checked — all {n} token ids of SDSAT equal vanilla '
                f'greedy decoding{partial}. SDSAT is lossless.</div>')
    a, b = record.vanilla.token_ids, record.sdsat.token_ids
    first = next((i for i in range(n) if a[i] != b[i]), n)
    decoding = record.costs.decoding if record.costs is not None else ""
    return (f'<div class="check bad">✗ Outputs differ at token {first + 1} of {n}. '
            f'{esc(mismatch_meaning(decoding))}</div>')


# What a greedy mismatch means, per numerics both decoders ran in (tuning.py's forms; docs/architecture.md).
MISMATCH = {
    "row-invariant": "In a row-invariant form a token's logits are bit-equal alone and in a block (the row check "
                     "verified it when this machine was measured), so greedy SDSAT must equal vanilla: this is a "
                     "bug. Please report the prompt and settings.",
    "float32": "In float32 with the fastest kernels (routed), or on a GPU, a row in a block differs from a "
               "one-token pass by rounding only, so a top token can flip where two logits nearly tie: rare, "
               "and not a bug.",
    "half": "In float16 or bfloat16 outside a row-invariant form (a GPU, or quantized), a row in a block differs "
            "from a one-token pass by up to tenths of a logit, so greedy outputs often differ (transformers' own "
            "prompt lookup as well).",
}


def mismatch_meaning(decoding: str) -> str:
    """What a greedy mismatch means in `decoding` (e.g. "bfloat16 row-invariant"; "" when the machine was not
    measured in the race's numerics, then every case is named)."""
    if "row-invariant" in decoding:
        return f"Both decoded in {decoding}. " + MISMATCH["row-invariant"]
    if decoding.startswith("float32"):
        return f"Both decoded in {decoding}. " + MISMATCH["float32"]
    if decoding:
        return f"Both decoded in {decoding}. " + MISMATCH["half"]
    return " ".join(MISMATCH.values())


def _mean_pass_ms(steps) -> float:
    times = [t for step in steps[1:] for t in step.pass_seconds]  # the first pass also reads the prompt
    return 1e3 * sum(times) / len(times) if times else float("nan")


def why_html(record: RaceRecord) -> str:
    """One line on what decided the speed-up: accepted drafts against the cost of a pass."""
    v, s = record.vanilla, record.sdsat
    if not s.steps or not v.steps:
        return ""
    v_ms, s_ms = _mean_pass_ms(v.steps), _mean_pass_ms(s.steps)
    passes = s.forward_passes / len(s.steps)
    text = (f"Why: each SDSAT iteration gave {s.mean_tokens_per_iteration:.2f} tokens for {passes:.2g} forward "
            f"passes of {s_ms:.0f} ms on average, against 1 token per {v_ms:.0f} ms pass for vanilla.")
    if not record.sat_trained:
        text += " With an untrained adapter almost no draft is accepted, so SDSAT cannot win yet."
    elif record.speedup < 1:
        text += " Few drafts were accepted on this prompt; code completion usually accepts more."
    return f'<div class="why muted">{esc(text)}</div>'


def _times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def speedup_note(record: RaceRecord) -> str:
    """The speed-up card's note: what it divides, and beside it the predicted and implied speed-ups."""
    costs = record.costs
    if costs is None:
        return "SDSAT ÷ vanilla tokens/s"
    return f"SDSAT ÷ vanilla tokens/s · predicted {_times(costs.predicted)} · its passes imply {_times(costs.implied)}"


def costs_html(record: RaceRecord) -> str:
    """Where the predicted and implied speed-ups come from (machine.py)."""
    costs = record.costs
    if costs is None:
        return ""
    text = (f"Predicted: the planner's replay of the SATs' acceptance trace under these settings, at the pass "
            f"costs measured on this machine ({costs.decoding}, {costs.one_token_ms:.1f} ms per one-token pass). "
            f"Implied: this race's {len(record.sdsat.token_ids)} tokens ÷ what its "
            f"{record.sdsat.forward_passes} passes cost at those prices. Both against vanilla in {costs.decoding}, "
            "as the race's vanilla ran. See This machine, under the plots.")
    return f'<div class="why muted costs">{esc(text)}</div>'


def fastest_card(record: RaceRecord) -> str:
    """Where another precision's vanilla is faster than the race's: the speed-up against it, estimated."""
    costs = record.costs
    if costs is None or not costs.estimated or costs.vs_fastest is None:
        return ""
    return _card(f"≈{costs.vs_fastest:.2f}×", "vs the fastest vanilla here",
                 esc(f"{costs.fastest} vanilla, {costs.fastest_ms:.1f} ms per token: estimated from the "
                     f"load-time measurement (× {costs.fastest_ms:.1f} ÷ {costs.one_token_ms:.1f} ms)"))


def headline_html(record: RaceRecord) -> str:
    v, s = record.vanilla, record.sdsat
    speed = record.speedup
    cards = "".join([
        _card(f"{v.tokens_per_second:.1f}", "vanilla tokens/s", f"{len(v.token_ids)} tokens, {v.seconds:.1f} s"),
        _card(f"{s.tokens_per_second:.1f}", "SDSAT tokens/s", f"{len(s.token_ids)} tokens, {s.seconds:.1f} s"),
        _card(f"{speed:.2f}×", "speed-up", esc(speedup_note(record)), "accent" if speed >= 1 else ""),
        fastest_card(record),
        _card(f"{s.mean_tokens_per_iteration:.2f}", "tokens / iteration",
              f"bonus counted; {s.mean_accepted_drafts:.2f} of k = {s.k} drafts accepted"),
        _card(f"{1 / s.tokens_per_forward_pass:.2f}", "passes / token",
              f"vanilla 1.00 · {v.forward_passes} → {s.forward_passes} passes"),
    ])
    limited = ('<div class="check info">A decoder reached the per-request time limit and was stopped early.</div>'
               if record.time_limited else "")
    if record.measuring:
        limited += (f'<div class="check info measuring">This race began while the page was {esc(record.measuring)}: '
                    "auto's plan was not ready, so auto stood for its fallback settings. Both decoders ran in the "
                    "same numerics, as loaded.</div>")
    meta = (f'<div class="meta">{sat_badge(record.sat_trained)} <span>{esc(record.model)}</span> · '
            f'<span>{esc(record.hardware)}</span> · '
            '<span>decoded one after the other (vanilla, then SDSAT), never at the same time</span></div>')
    return (f'<div class="headline"><div class="cards">{cards}</div>'
            f'{check_html(record)}{why_html(record)}{costs_html(record)}{limited}{meta}</div>')


def progress_html(snap: RaceSnapshot | None, message: str = "") -> str:
    """Status while a race runs."""
    if snap is None:
        return f'<div class="headline running"><div class="status">{esc(message)}</div></div>'
    done = {m: sum(len(st.tokens) for st in snap.steps[m]) for m in snap.steps}
    if snap.phase == "vanilla":
        text = (f"Running vanilla decoding… {done['vanilla']} tokens. "
                "SDSAT runs next, on its own, so the two never share the CPU.")
    else:
        text = f"Vanilla finished ({done['vanilla']} tokens). Running SDSAT… {done['sdsat']} tokens."
    return f'<div class="headline running"><div class="status"><span class="spinner"></span>{esc(text)}</div></div>'
