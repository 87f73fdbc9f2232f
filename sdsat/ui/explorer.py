"""The step explorer: one SDSAT iteration drawn as a table of positions, "draft, then verify".

Columns are the output positions the iteration can fill: column 0 is t (predicted from c, the last
token not yet in the cache), column j is draft d_j (predicted from SAT_j), and column k+1 is what
only the verify pass can give. Rows are the two forward passes, what each was fed and what it
predicted, and the verdict per position.
"""

from __future__ import annotations

from ..decoding import StepRecord
from .race import RaceRecord
from .render import esc, esc_title, visible


def _chip(text: str, cls: str = "", title: str = "") -> str:
    t = f' title="{esc_title(title)}"' if title else ""
    return f'<span class="chip {cls}"{t}>{esc(visible(text))}</span>'


def _sub(text: str) -> str:
    return f'<div class="sub">{esc(text)}</div>'


def context_ids(record: RaceRecord, index: int) -> list[int]:
    """Prompt and output before iteration `index` (its last token is c, not yet in the cache)."""
    done = [t for step in record.sdsat.steps[:index] for t in step.tokens]
    return record.prompt_ids + done


def explorer_html(record: RaceRecord | None, index: int) -> str:
    """HTML for iteration `index` (0-based) of the record's SDSAT run."""
    if record is None or not record.sdsat.steps:
        return '<div class="explorer empty">Run a prompt, then step through its SDSAT iterations here.</div>'
    steps = record.sdsat.steps
    index = max(0, min(index, len(steps) - 1))
    step: StepRecord = steps[index]
    word = record.vocab.get
    k, a = step.k, step.accepted
    ctx = context_ids(record, index)
    tail, c = ctx[-9:-1], ctx[-1]
    greedy = record.greedy
    bonus = step.tokens[-1] if step.sources and step.sources[-1] == "bonus" else None

    head = (f'<div class="ex-head"><b>Iteration {index + 1} of {len(steps)}</b> · k = {k} adaptive tokens · '
            f'cache {step.kv_len_before} → {step.kv_len} tokens · draft pass {step.pass_seconds[0] * 1e3:.0f} ms · '
            f'verify pass {step.pass_seconds[1] * 1e3:.0f} ms · emitted <b>{len(step.tokens)}</b> tokens '
            f'for 2 forward passes</div>')
    context = ('<div class="ex-context"><span class="ex-label">Context (tail)</span> … '
               + "".join(_chip(word(t, ""), "ctx") for t in tail)
               + _chip(word(c, ""), "ctx pending", "c: the last token, not yet in the KV cache")
               + ' <span class="muted">← c</span></div>')

    cols = range(k + 2)
    rows = []
    # Step 1: [c, SAT_1..SAT_k] -> t, d_1..d_k
    fed1 = [_chip(word(c, ""), "pending", "c")] + [f'<span class="chip sat">SAT<sub>{j}</sub></span>' for j in range(1, k + 1)] + [""]
    t = step.tokens[0]
    out1 = [_chip(word(t, ""), "src-verified", "t: what vanilla decoding would emit here") + _sub("t (certain)")]
    for j, d in enumerate(step.drafts, start=1):
        out1.append(_chip(word(d, ""), "draft", f"draft d{j}") + _sub(f"d{j} · q={step.draft_probs[j - 1]:.2f}"))
    out1.append("")
    rows.append(("Step 1 · draft pass fed", fed1))
    rows.append(("Step 1 · predicted", out1))
    # Step 2: [t, d_1..d_k] -> the model's own choice for positions 1..k+1
    fed2 = [_chip(word(t, ""), "src-verified")] + [_chip(word(d, ""), "draft") for d in step.drafts] + [""]
    choice = ['<span class="muted">—</span>']
    for j, pred in enumerate(step.predictions, start=1):
        label = f"model's choice after {'t' if j == 1 else f'd{j - 1}'}" + ("" if greedy else " (argmax of p)")
        choice.append(_chip(word(pred, ""), "pred", label))
    rows.append(("Step 2 · verify pass fed", fed2))
    rows.append(("Step 2 · model's choice", choice))
    # Verdict per position
    verdict = ['<span class="verdict ok">kept</span>']
    for j in range(1, k + 1):
        if j <= a:
            verdict.append('<span class="verdict ok">✓ accepted</span>')
        elif j == a + 1:
            verdict.append('<span class="verdict bad">✗ rejected</span>')
        else:
            verdict.append('<span class="verdict skip">not reached</span>')
    verdict.append("")
    if bonus is not None:
        verdict[a + 1] += _chip(word(bonus, ""), "src-bonus", "bonus: the model's own token here") + _sub("bonus")
    rows.append(("Verdict", verdict))

    header = "".join(f"<th>{'t' if j == 0 else (f'd{j}' if j <= k else 'after d' + str(k))}</th>" for j in cols)
    body = "".join(
        f'<tr><th class="row">{esc(name)}</th>' + "".join(f"<td>{cells[j]}</td>" for j in cols) + "</tr>"
        for name, cells in rows)
    table = f'<div class="ex-scroll"><table class="ex-table"><tr><th></th>{header}</tr>{body}</table></div>'

    emitted = "".join(_chip(record.pieces["sdsat"][_offset(record, index) + j], f"src-{src}")
                      for j, src in enumerate(step.sources))
    rule = ("Greedy: a draft is accepted when it equals the model's choice at its position and every earlier draft was accepted."
            if greedy else
            "Sampling: draft d<sub>j</sub> is accepted with probability min(1, p/q); at the first rejection the token is "
            "drawn from the normalised max(0, p − q), so the output follows the model's own distribution exactly.")
    result = (f'<div class="ex-result"><span class="ex-label">Emitted</span> {emitted} '
              f'<span class="muted">= t + {a} accepted draft{"s" if a != 1 else ""}'
              f'{" + bonus" if bonus is not None else ""}; rejected drafts left the cache.</span></div>'
              f'<div class="ex-rule muted">{rule}</div>')
    return f'<div class="explorer">{head}{context}{table}{result}</div>'


def _offset(record: RaceRecord, index: int) -> int:
    return sum(len(s.tokens) for s in record.sdsat.steps[:index])
