"""What the page starts with: the decoding schemes a visitor picks from.

"fastest" is the fastest setting measured on the shipped benchmarks (docs/results.md:
k = 3 with prompt lookup and a draft tree); "paper" is the paper's two-step scheme alone.
"""

from __future__ import annotations

from .settings import SettingError

SCHEMES = {
    "fastest": dict(k=3, lookup_tokens=10, tree_candidates=2),
    "paper": dict(k=3, lookup_tokens=0, tree_candidates=0),
}
SCHEME_LABELS = {  # the radio's choices -> SCHEMES keys
    "fastest (SATs + prompt lookup + draft tree)": "fastest",
    "paper (two-step SATs only)": "paper",
}
CUSTOM = "custom (the sliders below)"
DEFAULT_SCHEME = next(iter(SCHEME_LABELS))


def scheme_settings(label: str) -> dict:
    """k, lookup_tokens and tree_candidates of a scheme, by its radio label or its key."""
    key = SCHEME_LABELS.get(label, label)
    if key not in SCHEMES:
        raise SettingError(f"scheme must be one of: {', '.join(SCHEME_LABELS)}; got {label!r}")
    return dict(SCHEMES[key])


def scheme_of(k, lookup_tokens, tree_candidates) -> str:
    """The radio label that matches these slider values, or CUSTOM."""
    for label, key in SCHEME_LABELS.items():
        if SCHEMES[key] == dict(k=k, lookup_tokens=lookup_tokens, tree_candidates=tree_candidates):
            return label
    return CUSTOM
