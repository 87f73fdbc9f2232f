"""The step explorer: one SDSAT iteration drawn as a table of positions, "draft, then verify".

Columns are the output positions the iteration can fill: column 0 is t (predicted from c, the last
token not yet in the cache), column j is draft d_j (predicted from SAT_j), and column k+1 is what
only the verify pass can give. Rows are the two forward passes, what each was fed and what it
predicted, and the verdict per position. With prompt lookup on, the drafts may be copies l_j of
what followed the same text before: verified after t, or straight after c in a single pass. With a
draft tree, a row shows every candidate the verify pass checked, by depth: accepted, turned down by
the model, or not reached (below a candidate it turned down); the drafts shown are the walked path.
Under sampling, a table below gives each draft's accept test with the run's own numbers: p, q,
min(1, p/q), the uniform number drawn, the verdict, and on a rejection the residual distribution and
the token drawn from it; siblings of a tree in the order they were tried.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..decoding import StepRecord
from .race import RaceRecord
from ..records import AcceptTest
from .render import choice_name, draw_name, esc, esc_title, source_class, visible

# The accept test's columns, with what each means (the header's tooltip)
TEST_COLUMNS = (
    ("position", "the draft's position after t"),
    ("try", "siblings of a draft tree are tried in the order they were drawn; the first accepted one is kept"),
    ("draft x", "the token tried"),
    ("p(x)", "the model's probability of x here; on a later try, what the earlier rejections left of it "
             "(the residual)"),
    ("q(x)", "the probability x was drawn with: the SAT's q less the siblings drawn before it (1 for a copy)"),
    ("min(1, p/q)", "the chance that x is accepted"),
    ("u", "the uniform number drawn for this test: x is accepted when u < min(1, p/q)"),
    ("verdict", ""),
    ("residual after a rejection", "norm(max(0, p − q)): what the model may still emit here; the token drawn "
                                   "from it when every try at this position was rejected"),
)
ACCEPT_RULE = ("Each draft is accepted with probability min(1, p/q), so a draft the model likes at least as much "
               "as the drafter is always kept. After a rejection the model samples from what is left, max(0, p − q) "
               "normalised, or tries the next sibling against it, which makes every output token follow the "
               "model's own distribution exactly.")


def _chip(text: str, cls: str = "", title: str = "") -> str:
    t = f' title="{esc_title(title)}"' if title else ""
    return f'<span class="chip {cls}"{t}>{esc(visible(text))}</span>'


def _sub(text: str) -> str:
    return f'<div class="sub">{esc(text)}</div>'


def context_ids(record: RaceRecord, index: int) -> list[int]:
    """Prompt and output before iteration `index` (its last token is c, not yet in the cache)."""
    done = [t for step in record.sdsat.steps[:index] for t in step.tokens]
    return record.prompt_ids + done


@dataclass
class _View:
    """One iteration as the explorer draws it."""

    record: RaceRecord
    step: StepRecord
    index: int
    c: int  # the last token before the iteration, not yet in the KV cache

    def __post_init__(self) -> None:
        step = self.step
        self.word = self.record.vocab.get
        self.k, self.a = step.k, step.accepted
        self.copied = step.draft_source == "lookup"  # the drafts are prompt lookup's copies, not the SATs'
        self.drafted = step.draft_pass  # a draft pass gave t (without one, the drafts follow c directly)
        self.d = "l" if self.copied else "d"  # what the draft columns are called
        self.bonus = step.tokens[-1] if step.sources and step.sources[-1] == "bonus" else None


RACING = '<div class="explorer empty">The step explorer fills in when a race finishes.</div>'  # while one runs


def explorer_html(record: RaceRecord | None, index: int) -> str:
    """HTML for iteration `index` (0-based) of the record's SDSAT run."""
    if record is None or not record.sdsat.steps:
        return '<div class="explorer empty">Run a prompt, then step through its SDSAT iterations here.</div>'
    steps = record.sdsat.steps
    index = max(0, min(index, len(steps) - 1))
    ctx = context_ids(record, index)
    view = _View(record, steps[index], index, ctx[-1])
    rows = _draft_rows(view) + _verify_rows(view) + [("Verdict", _verdict(view))]
    return (f'<div class="explorer">{_head(view, len(steps))}{_context(view, ctx[-9:-1])}{_table(view, rows)}'
            f'{_accept_tests(view)}{_result(view)}</div>')


def _head(v: _View, iterations: int) -> str:
    step = v.step
    verify = f"verify pass {step.verify_pass_seconds * 1e3:.0f} ms"
    passes = f"draft pass {step.draft_pass_seconds * 1e3:.0f} ms · {verify}" if v.drafted else verify
    return (f'<div class="ex-head"><b>Iteration {v.index + 1} of {iterations}</b> · '
            + (f"{v.k} tokens copied by prompt lookup" if v.copied else f"k = {v.k} adaptive tokens")
            + (f" · the verify pass checked {step.candidates} candidates (a draft tree: the SATs' runner-ups too); "
               "shown is the path it walked" if step.candidates > len(step.drafts) else "")
            + (f" · drafts from the sampler head: d1 conditioned on {'t' if step.draft_pass else 'c'}, each later "
               "draft on the one before it" if step.conditioned else "")
            + f' · cache {step.kv_len_before} → {step.kv_len} tokens · {passes} · emitted <b>{len(step.tokens)}</b> '
            f'tokens for {step.forward_passes} forward pass{"es" if v.drafted else ""}</div>')


def _context(v: _View, tail: list[int]) -> str:
    return ('<div class="ex-context"><span class="ex-label">Context (tail)</span> … '
            + "".join(_chip(v.word(t, ""), "ctx") for t in tail)
            + _chip(v.word(v.c, ""), "ctx pending", "c: the last token, not yet in the KV cache")
            + ' <span class="muted">← c</span></div>')


def _draft_rows(v: _View) -> list[tuple[str, list[str]]]:
    """Step 1, [c, SAT_1..SAT_K] -> t (and K drafts), and what replaced or joined the drafts."""
    step, word, k = v.step, v.word, v.k
    rows = []
    if v.drafted:
        out1 = [_chip(word(step.tokens[0], ""), "src-verified", "t: what vanilla decoding would emit here")
                + _sub("t (certain)")]
        if v.copied:
            sats = v.record.settings.get("k", "k")
            fed1 = [_chip(word(v.c, ""), "pending", "c"), f'<span class="chip sat">SAT×{sats}</span>']
            out1.append(_sub("SAT drafts set aside: t completes text that occurred before, so the tokens that "
                             "followed it there are verified instead"))
        else:
            fed1 = [_chip(word(v.c, ""), "pending", "c")] + [f'<span class="chip sat">SAT<sub>{j}</sub></span>'
                                                             for j in range(1, k + 1)]
            ranks, name = step.draft_ranks or [0] * k, _rank_name(v)
            out1 += [_chip(word(dj, ""), "draft", f"draft d{j}: " + (
                         f"the SAT's {name(ranks[j - 1])}" if v.record.greedy else
                         f"the {name(ranks[j - 1])} from SAT {j}'s q") + _conditioned_on(step, j, long=True))
                     + _sub(f"d{j} · q={step.draft_probs[j - 1]:.2f}"
                            + (f" · {name(ranks[j - 1])}" if ranks[j - 1] else "") + _conditioned_on(step, j))
                     for j, dj in enumerate(step.drafts, start=1)]
        rows.append(("Step 1 · draft pass fed", _pad(fed1, k + 2)))
        rows.append(("Step 1 · predicted", _pad(out1, k + 2)))
        if step.tree_paths:
            cells = _tree_cells(step, word, k, _rank_name(v), sampled=not v.record.greedy)
            rows.append(("Draft tree · every candidate verified", cells))
    if v.copied:
        rows.append(("Prompt lookup copied", _pad(['<span class="muted">—</span>'] + [
            _chip(word(tok, ""), "copy", f"l{j}: the token that followed this text where it occurred before")
            + _sub(f"l{j}") for j, tok in enumerate(step.drafts, start=1)], v.k + 2)))
    return rows


def _conditioned_on(step: StepRecord, j: int, long: bool = False) -> str:
    """What draft j was conditioned on: with a sampler head, the token before the drafts for draft 1 (t after a
    draft pass; c, the last bonus, in a fused iteration), the draft before it after that; a SAT alone sees neither."""
    if not step.conditioned:
        return ", blind to t and to the drafts before it" if long and step.draft_pass else ""
    before = ("t" if step.draft_pass else "c") if j == 1 else f"d{j - 1}"
    return f", by the sampler head, conditioned on {before}" if long else f" · after {before}"


def _verify_rows(v: _View) -> list[tuple[str, list[str]]]:
    """The verify pass, [t or c, drafts] -> the model's own choice for positions 1..k+1."""
    step, word = v.step, v.word
    first, name = (step.tokens[0], "t") if v.drafted else (v.c, "c")  # what the verify pass starts from
    fed = _pad([_chip(word(first, ""), "src-verified" if v.drafted else "pending")] + [
        _chip(word(x, ""), "copy" if v.copied else "draft") for x in step.drafts], v.k + 2)
    choice = ['<span class="muted">—</span>']
    for j, pred in enumerate(step.predictions, start=1):
        label = (f"model's choice after {name if j == 1 else f'{v.d}{j - 1}'}"
                 + ("" if v.record.greedy else " (argmax of p)"))
        choice.append(_chip(word(pred, ""), "pred", label))
    verify = "Step 2 · verify pass" if v.drafted else "Verify pass"
    return [(f"{verify} fed", fed), (f"{verify} · model's choice", _pad(choice, v.k + 2))]


def _verdict(v: _View) -> list[str]:
    """Per position: kept, accepted, rejected, not reached; the bonus token after the accepted ones."""
    a = v.a
    verdict = ['<span class="verdict ok">kept</span>' if v.drafted else '<span class="muted">(emitted before)</span>']
    for j in range(1, v.k + 1):
        if j <= a:
            verdict.append('<span class="verdict ok">✓ accepted</span>')
        elif j > len(v.step.drafts):  # a draft tree's path ended in a runner-up with no candidates below it
            verdict.append('<span class="verdict skip">no candidate on this path</span>')
        elif j == a + 1:
            verdict.append('<span class="verdict bad">✗ rejected</span>')
        else:
            verdict.append('<span class="verdict skip">not reached</span>')
    verdict.append("")
    if v.bonus is not None:
        verdict[a + 1] += _chip(v.word(v.bonus, ""), "src-bonus", "bonus: the model's own token here") + _sub("bonus")
    return verdict


def _accept_tests(v: _View) -> str:
    """Sampling: one row per accept test, in the order verification ran them."""
    tests = v.step.accept_tests
    if not tests:
        return ""
    header = "".join(f'<th title="{esc_title(tip)}">{esc(name)}</th>' if tip else f"<th>{esc(name)}</th>"
                     for name, tip in TEST_COLUMNS)
    rows = [_test_row(v, test) for test in tests]
    if v.bonus is not None and tests[-1].accepted:  # the walk ended past its last test: the bonus is from p
        rows.append(f'<tr><td colspan="{len(TEST_COLUMNS)}" class="muted">the bonus '
                    f'{_chip(v.word(v.bonus, ""), "src-bonus")} was drawn from p after the last accepted draft'
                    "</td></tr>")
    return (f'<div class="ex-tests"><span class="ex-label">The accept test, draft by draft</span>'
            f'<div class="ex-scroll"><table class="ex-table accept-tests"><tr>{header}</tr>{"".join(rows)}'
            f'</table></div><div class="ex-rule muted">{esc(ACCEPT_RULE)}</div></div>')


def _test_row(v: _View, test: AcceptTest) -> str:
    name = f"{v.d}{test.depth}"
    verdict = ('<span class="verdict ok">✓ accepted</span>' if test.accepted else
               '<span class="verdict bad">✗ rejected</span>')
    residual = ""
    if test.residual:
        residual = " ".join(f'{_chip(v.word(t, ""), "resid")}<span class="sub-inline">{prob:.2f}</span>'
                            for t, prob in test.residual)
    if test.replacement is not None:
        residual += (f' <span class="muted">→ drew</span> '
                     f'{_chip(v.word(test.replacement, ""), "src-bonus", "drawn from the residual")}')
    tried = "copy" if v.copied else draw_name(test.rank)
    cells = [name, tried, _chip(v.word(test.token, ""), "draft" if test.accepted else "tree-no"),
             f"{test.p:.3f}" + (_sub("residual") if test.rank else ""), f"{test.q:.3f}", f"{test.ratio:.3f}",
             f"{test.u:.3f}", verdict, residual]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def _table(v: _View, rows: list[tuple[str, list[str]]]) -> str:
    cols, k, d = range(v.k + 2), v.k, v.d
    name = "t" if v.drafted else "c"
    header = "".join(f"<th>{name if j == 0 else (f'{d}{j}' if j <= k else f'after {d}{k}')}</th>" for j in cols)
    body = "".join(
        f'<tr><th class="row">{esc(label)}</th>' + "".join(f"<td>{cells[j]}</td>" for j in cols) + "</tr>"
        for label, cells in rows)
    return f'<div class="ex-scroll"><table class="ex-table"><tr><th></th>{header}</tr>{body}</table></div>'


def _result(v: _View) -> str:
    step, record, a = v.step, v.record, v.a
    emitted = "".join(_chip(record.pieces["sdsat"][_offset(record, v.index) + j], f"src-{source_class(step, src)}")
                      for j, src in enumerate(step.sources))
    kind = ("copy" if a == 1 else "copies") if v.copied else ("draft" if a == 1 else "drafts")
    rule = ("Greedy: a draft is accepted when it equals the model's choice at its position and every earlier draft "
            "was accepted." if record.greedy else
            "Sampling: draft d<sub>j</sub> is accepted with probability min(1, p/q); "
            "at the first rejection the token is "
            "drawn from the normalised max(0, p − q), so the output follows the model's own distribution exactly."
            + (" In a draft tree, the siblings at a position are tried in turn, each against what the earlier "
               "rejections left, before that draw." if v.step.tree_paths else "")
            + (" A copy has q = 1 on itself." if v.copied else ""))
    return (f'<div class="ex-result"><span class="ex-label">Emitted</span> {emitted} '
            f'<span class="muted">= {"t + " if v.drafted else ""}{a} accepted {kind}'
            f'{" + bonus" if v.bonus is not None else ""}; rejected drafts left the cache.</span></div>'
            f'<div class="ex-rule muted">{rule}</div>')


def _rank_name(v: _View):
    """How a SAT candidate's rank reads: a greedy tree's runner-ups are choices, a sampled tree's are draws."""
    return choice_name if v.record.greedy else draw_name


def _tree_cells(step: StepRecord, word, k: int, name=choice_name, sampled: bool = False) -> list[str]:
    """One cell per depth: the draft tree's candidates there, marked accepted, turned down or not reached
    (sampled: not tried, when a sibling drawn before it was accepted)."""
    walked = step.draft_ranks[:step.accepted]
    rejected = {(test.depth, test.rank) for test in step.accept_tests if not test.accepted}
    cells = ['<span class="muted">—</span>'] + [""] * (k + 1)
    for path, token in zip(step.tree_paths, step.tree_tokens):
        depth = len(path)
        compared = path[:-1] == walked[:depth - 1] and depth - 1 <= len(walked)  # its parent was accepted
        if path == walked[:depth] and depth <= len(walked):
            cls, mark = "draft", "✓"
        elif compared and (not sampled or (depth, path[-1]) in rejected):
            cls, mark = "tree-no", "✗"  # greedy: the model compared it; sampled: its accept test failed
        else:
            cls, mark = "tree-skip", "·"  # below a candidate turned down, or not tried
        after = f", after {' → '.join(name(r) for r in path[:-1])}" if depth > 1 else ""
        title = f"the SAT's {name(path[-1])} for position {depth}{after}"
        cells[depth] += (f'<div class="tree-node">{_chip(word(token, ""), cls, title)} '
                         f'<span class="sub">{mark} {esc(name(path[-1]).split()[0])}</span></div>')
    return cells


def _pad(cells: list[str], width: int) -> list[str]:
    return cells + [""] * (width - len(cells))


def _offset(record: RaceRecord, index: int) -> int:
    return sum(len(s.tokens) for s in record.sdsat.steps[:index])
