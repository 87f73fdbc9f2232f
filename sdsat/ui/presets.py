"""What the page starts with: the decoding schemes a visitor picks from.

"auto" is the engine's plan for this machine (docs/architecture.md, "Automatic settings"): the k,
prompt lookup and draft tree predicted fastest from the pass costs measured at load. The page has no
fused control, so it asks for the best two-step plan; under sampling, the best one for sampling.
"paper" is the paper's two-step scheme alone.

A fixed "fastest" preset (k = 3, lookup 10, tree 2) used to lead. It was the fastest setting on one
AMD EPYC (1.78–1.89× there, 1.25× on an Intel Xeon with AMX, issue 15), and `auto` finds the best
setting of whichever machine serves the page, so it replaced that preset. Its values remain auto's
fallback where no plan exists (SATs without an acceptance trace, or a machine not measured).
"""

from __future__ import annotations

from ..planner import FALLBACK
from ..tuning import Tuning
from .settings import SettingError

AUTO = "auto"
FIXED = {  # the page's fixed presets; auto's values depend on the machine and the model
    "paper": dict(k=3, lookup_tokens=0, tree_candidates=0),
}
SCHEME_LABELS = {  # the radio's choices -> AUTO or FIXED keys
    "auto (predicted fastest on this machine)": AUTO,
    "paper (two-step SATs only)": "paper",
}
CUSTOM = "custom (the sliders below)"
# The race's sampling settings as the page opens; auto's sampled plan on the page is the one for them.
PAGE_SAMPLING = dict(temperature=0.8, top_p=0.95, top_k=50)
DEFAULT_SCHEME = next(iter(SCHEME_LABELS))


def auto_settings(tuning: Tuning | None, greedy: bool = True, max_k: int | None = None,
                  temperature: float = PAGE_SAMPLING["temperature"], top_p: float = PAGE_SAMPLING["top_p"],
                  top_k: int = PAGE_SAMPLING["top_k"], chat: bool = False) -> dict:
    """k, lookup_tokens and tree_candidates of the machine's two-step plan (FALLBACK without one), k at most
    `max_k`; for sampling, the plan at `temperature`, `top_p` and `top_k` (the page's defaults unless given);
    `chat`: the plan for chat requests (Tuning.plan_for)."""
    plan = tuning.plan_for(("two_step",), greedy, temperature, top_p, top_k, chat) if tuning is not None else None
    chosen = dict(FALLBACK) if plan is None else dict(k=plan.settings.k, lookup_tokens=plan.settings.lookup_tokens,
                                                      tree_candidates=plan.settings.tree_candidates)
    if max_k is not None:
        chosen["k"] = min(chosen["k"], max_k)
    return chosen


def scheme_settings(label: str, auto: dict | None = None) -> dict:
    """k, lookup_tokens and tree_candidates of a scheme, by its radio label or its key; `auto` holds the
    values of AUTO (auto_settings; FALLBACK when not given)."""
    key = SCHEME_LABELS.get(label, label)
    if key == AUTO:
        return dict(auto or FALLBACK)
    if key not in FIXED:
        raise SettingError(f"scheme must be one of: {', '.join(SCHEME_LABELS)}; got {label!r}")
    return dict(FIXED[key])


def scheme_of(k, lookup_tokens, tree_candidates, auto: dict | None = None) -> str:
    """The radio label that matches these slider values (auto first), or CUSTOM."""
    values = dict(k=k, lookup_tokens=lookup_tokens, tree_candidates=tree_candidates)
    for label in SCHEME_LABELS:
        if scheme_settings(label, auto) == values:
            return label
    return CUSTOM
