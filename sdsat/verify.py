"""Verification: one forward pass over the candidates decides which drafts the model keeps.

`p` is the target model's distribution after a position (what vanilla decoding draws from), `q` the
distribution a draft was drawn from (the SAT's, or all mass on a copy). Both functions keep the start
token and the accepted drafts in the cache and drop everything else, so after them the cache holds
exactly what vanilla decoding would have fed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kvcache import behind_cache, keep_rows, rollback
from .layout import SatLayout
from .records import AcceptTest
from .sampling import TokenChooser
from .sat import SatModel
from .tree import DraftTree


@dataclass(kw_only=True)
class Verdict:
    p: torch.Tensor  # (len(shown) + 1, V): the model after the start token and after each shown draft
    accepted: int  # drafts accepted, a prefix of `shown`
    bonus: int  # the model's own next token after the accepted drafts
    shown: list[int]  # the drafts the record shows: the chain, or the path a tree's walk took
    shown_rows: list[int] = field(default_factory=list)  # tree: the node index of each shown draft
    node_tokens: list[int] = field(default_factory=list)  # tree: every node's token
    next_logits: torch.Tensor | None = None  # fused: (k, V) the SAT run after the accepted drafts: its logits
    next_hidden: torch.Tensor | None = None  # fused, a model with a plain head: (k, H) that run's final hidden states
    tests: list[AcceptTest] = field(default_factory=list)  # sampling: every draft's accept test, in order


def verify_chain(sat_model: SatModel, chooser: TokenChooser, cache, start: int, drafts: torch.Tensor,
                 q: torch.Tensor | None, draft_next: int = 0) -> Verdict:
    """Feed [start, d_1..d_n]; accept the longest prefix the model agrees with (greedy), or by speculative
    sampling with q (n, V). With `draft_next` = k the same pass also runs the SATs for the next k drafts (the
    fused scheme): one run of k SATs is anchored at each of start, d_1..d_n, one branch per possible accepted
    length a; once verification has fixed a, the run anchored at d_a has seen exactly the accepted context, and
    the Verdict carries its logits and hidden states (the drafter chooses the drafts once it knows the bonus).
    """
    if draft_next:
        return _verify_fused(sat_model, chooser, cache, start, drafts, q, draft_next)
    base = cache.get_seq_length()
    block = torch.cat([torch.tensor([start], device=drafts.device), drafts])[None]
    p = chooser.probs(sat_model.forward(block, cache=cache)[0])  # (n + 1, V)
    if q is None and chooser.config.do_sample:  # copies: all mass on each copied token (greedy ignores q)
        q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)
    accepted, bonus, tests = chooser.accept(p, q, drafts)
    rollback(cache, base + 1 + accepted)
    return Verdict(p=p, accepted=accepted, bonus=bonus, shown=drafts.tolist(), tests=tests)


def fused_block(start: int, drafts: torch.Tensor, k: int, base: int, device) -> dict:
    """SatModel's inputs for a fused pass behind `base` cached tokens: [start, drafts] and a run of k SATs anchored
    at each of those tokens."""
    n = len(drafts)
    layout = SatLayout.runs_at(n + 1, torch.arange(n + 1), k)
    block = torch.cat([torch.tensor([start], device=device), drafts.to(device),
                       torch.zeros(layout.num_sats, dtype=torch.long, device=device)])
    return dict(input_ids=block[None], sat_slots=layout.sat_slots.to(device),
                attention_mask=behind_cache(layout.attention_mask(), base, device),
                position_ids=layout.position_ids.to(device) + base)


def _verify_fused(sat_model: SatModel, chooser: TokenChooser, cache, start: int, drafts: torch.Tensor,
                  q: torch.Tensor, k: int) -> Verdict:
    n, base = len(drafts), cache.get_seq_length()
    inputs = fused_block(start, drafts, k, base, sat_model.device) | dict(cache=cache)
    # Only the n + 1 verify rows and the k rows of one branch need logits: projecting just those onto
    # the vocabulary skips most of the largest matrix's rows.
    if sat_model.plain_head:
        rows, project = sat_model.hidden_states(**inputs)[0], sat_model.head
    else:  # logits of every row, as the model's own head computes them
        rows, project = sat_model.forward(**inputs)[0], (lambda logits: logits)
    p = chooser.probs(project(rows[:n + 1]))
    accepted, bonus, tests = chooser.accept(p, q, drafts)
    run = rows[n + 1 + accepted * k:][:k]  # the SATs anchored at the last accepted token: they draft after the bonus
    rollback(cache, base + 1 + accepted)
    return Verdict(p=p, accepted=accepted, bonus=bonus, shown=drafts.tolist(), next_logits=project(run),
                   next_hidden=run if sat_model.plain_head else None, tests=tests)


def verify_tree(sat_model: SatModel, chooser: TokenChooser, cache, start: int, tokens: torch.Tensor,
                tree: DraftTree, q: torch.Tensor | None = None, draws: torch.Tensor | None = None,
                valid: list[int] | None = None) -> Verdict:
    """Verify pass over [start, every node of `tree`] (node tokens (n,)); keeps start and the accepted path in
    the cache. Each node sees the cache, start and its ancestors, and stands at its depth. Greedy walks the
    model's argmax; sampling needs what the nodes were drawn from: q (depth, V), the ranked draws
    (depth, width) and how many of each depth's are real (`TokenChooser.draw_ranked`)."""
    device = sat_model.device
    base = cache.get_seq_length()
    logits = sat_model.forward(torch.cat([torch.tensor([start], device=device), tokens])[None], cache=cache,
                               attention_mask=behind_cache(tree.attention_mask, base, device),
                               position_ids=tree.position_offsets.to(device) + base)[0]
    p = chooser.probs(logits)
    node_tokens, tests = tokens.tolist(), []
    if chooser.config.do_sample:
        accepted, bonus, tests = _sample_walk(chooser, tree, p, q, draws.tolist(), valid)
        shown = tree.shown(accepted)
    else:
        predictions = p.argmax(-1).tolist()
        accepted, shown = tree.walk(predictions, node_tokens)
        bonus = predictions[accepted[-1] + 1 if accepted else 0]
    keep_rows(cache, base, 1 + len(tokens), [0] + [i + 1 for i in accepted])
    rows = [0] + [i + 1 for i in shown]
    return Verdict(p=p[rows], accepted=len(accepted), bonus=bonus, shown=[node_tokens[i] for i in shown],
                   shown_rows=shown, node_tokens=node_tokens, tests=tests)


def _sample_walk(chooser: TokenChooser, tree: DraftTree, p: torch.Tensor, q: torch.Tensor, draws: list[list[int]],
                 valid: list[int]) -> tuple[list[int], int, list[AcceptTest]]:
    """Down from t: at each node, its children are tried in the order they were drawn (`try_siblings`); the
    accepted one is the next node. Ends at a node whose children were all rejected (the bonus is drawn from
    what they left of p) or at a leaf (drawn from p). Returns the accepted nodes, the bonus and the tests."""
    accepted, tests, node = [], [], -1
    while True:
        depth = len(accepted)
        children = [c for c in tree.children.get(node, []) if tree.paths[c][-1] < valid[depth]]
        if not children:
            return accepted, chooser.sample(p[node + 1]), tests
        taken, bonus, tried = chooser.try_siblings(p[node + 1], q[depth], draws[depth],
                                                   [tree.paths[c][-1] for c in children], depth + 1)
        tests += tried
        if taken is None:
            return accepted, bonus, tests
        node = children[taken]
        accepted.append(node)
