"""HTML for generated text, coloured token by token from the decoders' step records.

Colours come from each token's `source` in the StepRecord (never from matching strings), so code
formatting survives and a repeated word is coloured by how it was produced. Every piece of model
or visitor text goes through `esc`, which also defuses the template syntax of Gradio's HTML
component (`${...}`, `{{...}}`).
"""

from __future__ import annotations

import html
from typing import Sequence

from ..decoding import StepRecord

SOURCE_LABEL = {
    "verified": "step 1: the model's certain next token t",
    "draft": "accepted draft",
    "bonus": "step 2: the model's own token after the accepted drafts (bonus)",
}
# Control characters become their visible "control pictures" (U+2400 block); \n and \t stay as layout.
_CONTROL = {c: chr(0x2400 + c) for c in range(32) if chr(c) not in "\n\t"} | {0x7F: "\u2421"}
# C1 controls (U+0080..U+009F; U+0085 breaks lines in some renderers), the bidirectional controls that can
# make text read differently from its code points (a "Trojan Source" right-to-left override), and the
# Unicode line separators have no picture: they are shown as their code point, e.g. ⟨U+202E⟩.
_INVISIBLE = [*range(0x80, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A),
              0x2028, 0x2029]
_CONTROL |= {c: f"\u27e8U+{c:04X}\u27e9" for c in _INVISIBLE}


def esc(text: str) -> str:
    """Text -> HTML text: markup escaped, quotes too (safe in attributes), template syntax defused."""
    text = text.translate(_CONTROL)
    return (html.escape(text, quote=True).replace("$", "&#36;").replace("{", "&#123;")
            .replace("}", "&#125;").replace("`", "&#96;"))


def esc_title(text: str) -> str:
    """Text for a title="..." tooltip; newlines kept as line breaks."""
    return esc(text).replace("\n", "&#10;")


def visible(piece: str) -> str:
    """A token's text with whitespace made visible, for chips that show single tokens."""
    if piece == "":
        return "\u2205"
    return piece.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")


class PieceDecoder:
    """Token ids -> the text each one adds, decoding incrementally as tokens stream in.

    A token that ends inside a multi-byte character adds "" and the character goes to the token
    that completes it, so the pieces always join to the decoded text. A few tokens of context are
    decoded with each new token because some tokenizers drop a leading space when a token is
    decoded alone.
    """

    def __init__(self, tokenizer, context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(context_ids)[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        self.ids.append(token)
        if token in self.special:  # shown as its own name, e.g. <|im_end|>
            self.prefix_offset = self.read_offset = len(self.ids)
            return self._decode([token])
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an unfinished character), for the last token."""
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""


def pieces_of(tokenizer, ids: Sequence[int], context_ids: Sequence[int] = ()) -> list[str]:
    decoder = PieceDecoder(tokenizer, context_ids)
    pieces = [decoder.add(t) for t in ids]
    if pieces:
        pieces[-1] += decoder.flush()
    return pieces


def _token(piece: str, classes: str, title: str, special: bool = False, at: float | None = None) -> str:
    """One token's span; `at` (seconds since the request started) is what the browser's replay reads."""
    cls = f"tok {classes}" + (" special" if special else "") + ("" if piece else " empty")
    when = "" if at is None else f' data-t="{at:.3f}"'
    return f'<span class="{cls}" title="{esc_title(title)}"{when}>{esc(piece)}</span>'


def _p(prob: float) -> str:
    return f"{prob:.3f}" if prob >= 0.001 else f"{prob:.1e}"


def vanilla_html(steps: Sequence[StepRecord], pieces: Sequence[str], special_ids=frozenset()) -> str:
    """The vanilla output: one token per forward pass, alternating shades so token edges show."""
    spans = []
    for step, piece in zip(steps, pieces):
        token = step.tokens[0]
        title = f"step {step.index + 1} (one forward pass)\ntoken id {token}  {piece!r}\np = {_p(step.probs[0])}"
        spans.append(_token(piece, f"src-vanilla shade{step.index % 2}", title, token in special_ids, step.elapsed))
    return _pane("".join(spans), "vanilla")


def sdsat_html(steps: Sequence[StepRecord], pieces: Sequence[str], vocab: dict[int, str] | None = None,
               show_rejected: bool = False, special_ids=frozenset()) -> str:
    """The SDSAT output coloured by token source, one bordered group per iteration.

    Args:
        pieces: text of each emitted token, in order over all steps.
        vocab: text of single token ids, for rejected drafts (needed when show_rejected).
    """
    vocab = vocab or {}
    groups, at = [], 0
    for step in steps:
        spans = []
        n = len(step.tokens)
        head = int(step.sources[:1] == ["verified"])  # drafts follow t, or c when no draft pass gave a t
        for j, (token, source, prob) in enumerate(zip(step.tokens, step.sources, step.probs)):
            piece = pieces[at + j] if at + j < len(pieces) else ""
            position = j - head + 1
            where = f"draft position {position} of {step.k}" if source == "draft" else SOURCE_LABEL[source]
            title = f"iteration {step.index + 1} · {where}\ntoken id {token}  {piece!r}\np = {_p(prob)}"
            if source == "draft":
                title += f"   ({_draft_origin(step, position - 1)})"
            if show_rejected and source == "bonus":
                spans.extend(_rejected(step, vocab))
            spans.append(_token(piece, f"src-{source_class(step, source)}", title, token in special_ids, step.elapsed))
        if show_rejected and (not step.sources or step.sources[-1] != "bonus"):
            spans.extend(_rejected(step, vocab))  # output was cut before the bonus
        at += n
        groups.append(f'<span class="iter" data-t="{step.elapsed:.3f}" '
                      f'title="iteration {step.index + 1}: {n} tokens for '
                      f'{step.forward_passes} forward pass{"es" if step.forward_passes != 1 else ""}">'
                      f'{"".join(spans)}</span>')
    return _pane("".join(groups), "sdsat")


def _rejected(step: StepRecord, vocab: dict[int, str]) -> list[str]:
    spans = []
    for pos, token in enumerate(step.rejected, start=step.accepted + 1):
        piece = vocab.get(token, "")
        why = ("the model chose differently here" if pos == step.accepted + 1
               else "not reached: an earlier draft was rejected")
        title = (f"iteration {step.index + 1} · rejected draft at position {pos} of {step.k}\n{why}\n"
                 f"token id {token}  {piece!r}\n{_draft_origin(step, pos - 1)}")
        # Not part of the text: whitespace is shown as a sign, or a rejected newline would be invisible.
        spans.append(_token(visible(piece), "src-rejected", title, at=step.elapsed))
    return spans


def source_class(step: StepRecord, source: str) -> str:
    """How an emitted token is coloured: by its source, accepted prompt-lookup copies apart from SAT drafts."""
    return "copy" if source == "draft" and step.draft_source == "lookup" else source


def _draft_origin(step: StepRecord, i: int) -> str:
    if step.draft_source == "lookup":
        return "copied by prompt lookup"
    rank = step.draft_ranks[i] if i < len(step.draft_ranks) else 0
    return (f"q = {_p(step.draft_probs[i])} from the SAT"
            + (f" (its {choice_name(rank)}, from the draft tree)" if rank else ""))


def choice_name(rank: int) -> str:
    """0 -> "first choice", 1 -> "2nd choice", ...: a SAT candidate's rank in words."""
    return "first choice" if rank == 0 else f"{rank + 1}{ {1: 'nd', 2: 'rd'}.get(rank, 'th')} choice"


def draw_name(order: int) -> str:
    """0 -> "1st draw", 1 -> "2nd draw", ...: a sampled candidate's place among its depth's draws."""
    return f"{order + 1}{ {0: 'st', 1: 'nd', 2: 'rd'}.get(order, 'th')} draw"


def _pane(body: str, kind: str) -> str:
    body = body or '<span class="placeholder">…</span>'
    return f'<div class="sdsat-out {kind}">{body}</div>'


def waiting_html(message: str) -> str:
    return f'<div class="sdsat-out waiting"><span class="placeholder">{esc(message)}</span></div>'


def legend_html(show_rejected: bool = True) -> str:
    items = [("src-verified", "t", "step 1 token (certain)"), ("src-draft", "draft", "accepted draft"),
             ("src-copy", "copy", "accepted prompt-lookup copy"), ("src-bonus", "bonus", "step 2 bonus token")]
    if show_rejected:
        items.append(("src-rejected", "draft", "rejected draft (when shown)"))
    chips = "".join(f'<span class="legend-item"><span class="tok {c}">{esc(s)}</span> {esc(t)}</span>'
                    for c, s, t in items)
    return (f'<div class="legend">{chips}'
            '<span class="legend-item"><span class="iter-mark"></span> iteration boundary</span>'
            '<span class="legend-item muted">hover a token for its step, draft position and probability</span></div>')
