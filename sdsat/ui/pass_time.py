"""Where a forward pass's time goes on the machine serving the page: the This machine panel's split.

SDSAT's passes are split in the form it decodes in (one token; a verify pass of k + 1 tokens; a draft pass
[t, SAT×k]), and where the fastest vanilla runs in another precision or form, its one-token pass in that one,
with `pass_parts.split_passes` behind a cache of CONTEXT tokens. The page runs it on the compute thread, between
visitors' decodes, on request: it takes a few seconds.
"""

from __future__ import annotations

from ..engine import Engine
from ..pass_parts import PASS_PARTS, Split, split_passes
from ..tuning import dtype_name, form_of, trying
from .render import esc

CONTEXT = 256  # cached tokens behind each pass, as the tuning's curves have
REPEATS = 3  # timed rounds; the median round is shown


def split_here(engine: Engine, k: int) -> dict[str, Split]:
    """The splits of SDSAT's passes at draft depth `k`, then the fastest vanilla's one-token pass where it
    decodes in another precision or form; by label, in that order."""
    sat_model = engine.sat_model
    kernels = engine.load_config.cpu_kernels
    blocks = {"one token": ("plain", 1), f"verify, {k + 1} tokens": ("plain", k + 1),
              f"draft [t, SAT×{k}]": ("draft", k)}
    own = f"{dtype_name(sat_model.model)} {form_of(sat_model.model)}"
    splits = {f"SDSAT's form ({own}): {label}": split
              for label, split in split_passes(sat_model, blocks, CONTEXT, REPEATS).items()}
    fastest = engine.tuning.baseline[0] if engine.tuning is not None and engine.tuning.curves else own
    if fastest != own:
        precision, _, form = fastest.partition(" ")
        with trying(sat_model, precision, kernels, form):
            one = split_passes(sat_model, {"one token": ("plain", 1)}, CONTEXT, REPEATS)["one token"]
        splits[f"the fastest vanilla ({fastest}): one token"] = one
    return splits


def split_html(splits: dict[str, Split]) -> str:
    """The splits as a table: ms per part, each pass's total, and each part's share of it."""
    head = "".join(f"<th>{esc(part)}</th>" for part in PASS_PARTS)
    rows = []
    for label, split in splits.items():
        cells = "".join(f"<td>{1e3 * split.parts[part]:.1f} ({split.parts[part] / split.total_s:.0%})</td>"
                        for part in PASS_PARTS)
        rows.append(f"<tr><td>{esc(label)}</td><td><b>{1e3 * split.total_s:.1f}</b></td>{cells}</tr>")
    return ('<div class="machine"><table class="pass-split"><tr><th>pass</th><th>ms</th>' + head + "</tr>"
            + "".join(rows) + "</table><div>Each part is timed by wrapping what does it for the length of a pass; "
            "“other” is what the parts leave of the pass: embeddings, residual adds, the MLP's activation, masks "
            "and the framework's own Python. The timers add time of their own to every part, so compare the parts "
            "and the passes with each other, not these totals with the curve above. The median of "
            f"{REPEATS} rounds, measured just now on this machine.</div></div>")
