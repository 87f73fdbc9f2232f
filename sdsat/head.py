"""The sampler head: each SAT draft conditioned on the token before it.

A SAT row is computed in the same pass as the certain token t, so on its own SAT 1 guesses the token after
a token it cannot see, and SAT j guesses without drafts 1..j-1. The head closes that gap cheaply: it
rescores SAT j's own top-K candidates given the token before the draft (t for draft 1, draft j-1 after
that), prev:

    score_c = z_j[c] + w_j log P(c | prev) + v_j log(1 + n(prev, c)) + x_j log(1 + n(prev2, prev, c))
              + u_j . E_out[c] (+ g_j(terms of c)) + m_j log(1 + max(0, L(c) - 2))    for c in top-K(z_j)
    u_j     = MLP(h_j, E_in[prev], j)          z_j: the SAT's own logits, h_j: its final hidden state (after the norm)

P(c | prev) is a bigram table counted over code and prose on the machine, n(prev, c) how often prev was
followed by c earlier in this text (the prompt and what was decoded), n(prev2, prev, c) how often the two
tokens before the draft were, L(c) the longest run of the text's last tokens (ending at prev, up to MATCH_CAP)
that was followed by c earlier: the counts stop at two tokens, the match term goes on from three (prompt
lookup's signal, as a score rather than a copy). Each term is optional. A combiner may add g_j(terms of c): a
small MLP over a candidate's terms (and its score's distance from the best), so that they may weigh each other;
the match term comes after it. The shipped head rescores 32 candidates with the three table terms, an MLP of
width 256 trained beside them once they had converged, a combiner and the match term (its record,
sampler_head_record.json, says how). u_j shifts h_j, so the MLP's term is the logits row of h_j + u_j read at the
K candidates only (a full-vocabulary product per draft, sequentially, would cost a sizeable part of a one-token
pass on a CPU). The draft distribution q_j is the head's exact one: the sampler's warpers and softmax over its K
candidates (its logits are -inf elsewhere), so the accept test min(1, p/q) and the residual stay exact.

Files, beside the SAT adapter: ``sampler_head.safetensors`` and ``sampler_head.json`` (`HeadConfig`);
loading is the exact inverse of saving. Training: sdsat/train/head.py.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from . import native

HEAD_CONFIG_FILE = "sampler_head.json"
COMBINED_TERMS = 6  # what the combiner reads per candidate (`SamplerHead.combine`)
HEAD_WEIGHTS_FILE = "sampler_head.safetensors"
MATCH_CAP = 16  # the longest match the match term measures (L(c) in the module's formula)


class Terms(NamedTuple):
    """A candidate's terms before the text's counts, each (N, K) float32: the SAT's logit z, the bigram table's
    log P(c | prev) (0 without one), and the MLP's u . E_out[c] (None without one)."""

    z: torch.Tensor
    pair: torch.Tensor
    mlp: torch.Tensor | None


@dataclass
class HeadConfig:
    """Shape of a sampler head; saved as sampler_head.json."""

    base_model: str  # the base model it was trained for (informational)
    hidden_size: int  # H: the base model's hidden size
    num_sats: int = 5  # SAT positions with weights of their own (= the adapter's largest k); later ones share the last
    width: int = 512  # hidden units of the MLP (0: no MLP, the table terms alone)
    depth: int = 1  # hidden layers of the MLP (1: one hidden layer; 2: the two-layer variant)
    dropout: float = 0.0  # of the MLP's hidden units, in training only
    candidates: int = 16  # K: each SAT's top-K candidates are rescored; the others get no mass
    vocab_size: int = 0  # V of the bigram table (0: no bigram term)
    context: bool = False  # also v_j log(1 + how often prev was followed by c earlier in this text)
    context3: bool = False  # also x_j log(1 + how often the two tokens before the draft were followed by c earlier)
    combiner: int = 0  # hidden units of a small MLP over each candidate's terms, added to its score (0: none)
    match: bool = False  # also m_j log(1 + max(0, L(c) - 2)), L(c) the longest match of the text's end followed by c


class SamplerHead(nn.Module):
    """Scores of SAT j's K candidates c given the token before the draft:

        z[c] + w_j log P(c | prev) + v_j log(1 + n(prev, c)) + x_j log(1 + n(prev2, prev, c)) + u . E_out[c],
        u = MLP([norm(h_j), norm(E_in[prev])] + bias of j)

    P(c | prev) comes from a bigram table counted over text on the machine (`bigram_keys` prev * V + c, sorted,
    their counts, and each prev's total), read at the K candidates only; n(prev, c) from the text itself
    (`seen_after`), n(prev2, prev, c) likewise for the two tokens before the draft; w_j, v_j and x_j are learned
    per SAT position. With a combiner, g = MLP(the candidate's terms, its score less the best one's; j) is added.
    """

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        hidden, width = config.hidden_size, config.width
        self.pair_weight = nn.Parameter(torch.zeros(config.num_sats))  # (num_sats,) w_j
        self.context_weight = nn.Parameter(torch.zeros(config.num_sats))  # (num_sats,) v_j
        self.context3_weight = nn.Parameter(torch.zeros(config.num_sats))  # (num_sats,) x_j
        self.match_weight = nn.Parameter(torch.zeros(config.num_sats))  # (num_sats,) m_j
        self.register_buffer("bigram_keys", torch.zeros(0, dtype=torch.long))  # (P,) sorted
        self.register_buffer("bigram_counts", torch.zeros(0))  # (P,)
        self.register_buffer("prev_counts", torch.zeros(config.vocab_size))  # (V,)
        if width:
            self.norm_h = nn.LayerNorm(hidden)
            self.norm_prev = nn.LayerNorm(hidden)
            self.inp = nn.Linear(2 * hidden, width)
            self.position = nn.Parameter(torch.zeros(config.num_sats, width))  # (num_sats, width)
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(config.depth - 1))
            self.out = nn.Linear(width, hidden)
            with torch.no_grad():  # u = 0 at the start
                self.out.weight.zero_()
                self.out.bias.zero_()
        if config.combiner:
            self.combine_in = nn.Linear(COMBINED_TERMS, config.combiner)
            self.combine_position = nn.Parameter(torch.zeros(config.num_sats, config.combiner))
            self.combine_out = nn.Linear(config.combiner, 1)
            with torch.no_grad():  # g = 0 at the start
                self.combine_out.weight.zero_()
                self.combine_out.bias.zero_()

    def set_bigrams(self, table: dict[str, torch.Tensor]) -> None:
        """Take a bigram table (`sdsat.train.head.count_bigrams`)."""
        self.bigram_keys = table["bigram_keys"].long()
        self.bigram_counts = table["bigram_counts"].float()
        self.prev_counts = table["prev_counts"].float()

    def pair_logp(self, prev: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """prev (N,), cand (N, K) -> (N, K) smoothed log P(cand | prev) from the bigram table (0 without one)."""
        if not self.config.vocab_size or not len(self.bigram_keys):
            return torch.zeros(cand.shape, device=cand.device)
        keys = prev[:, None].long() * self.config.vocab_size + cand.long()
        at = torch.searchsorted(self.bigram_keys, keys).clamp_(max=len(self.bigram_keys) - 1).view(-1)
        # index_select rather than indexing: a draft pass reads a few thousand entries, where indexing's setup costs
        # several times the read
        found = self.bigram_keys.index_select(0, at).view(keys.shape) == keys
        count = torch.where(found, self.bigram_counts.index_select(0, at).view(keys.shape), 0.0)
        total = self.prev_counts.index_select(0, prev.long())[:, None]
        return torch.log((count + 0.1) / (total + 0.1 * cand.shape[-1]))

    def correction(self, h: torch.Tensor, prev: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """h (N, H) SAT hidden states, prev (N, H) input embeddings of the tokens before, slot (N,) j - 1
        -> u (N, H) (zeros without an MLP)."""
        if not self.config.width:
            return torch.zeros_like(h)
        x = torch.cat([self.norm_h(h), self.norm_prev(prev)], -1)
        drop = self.config.dropout if self.training else 0.0
        x = nn.functional.dropout(nn.functional.gelu(self.inp(x) + self.position[slot]), drop)
        for layer in self.layers:
            x = nn.functional.dropout(nn.functional.gelu(layer(x)), drop)
        return self.out(x)

    def scores(self, h: torch.Tensor, prev: torch.Tensor, slot: torch.Tensor, cand: torch.Tensor,
               cand_logits: torch.Tensor, embed_in: torch.Tensor, embed_out: torch.Tensor,
               seen: torch.Tensor | None = None, seen3: torch.Tensor | None = None,
               match: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The K candidates' scores (N, K) float32 and the correction u (N, H).

        Args:
            h: (N, H) SAT rows' final hidden states; prev: (N,) the token before each draft; slot: (N,) j - 1.
            cand: (N, K) each SAT's top candidates; cand_logits: (N, K) their SAT logits z.
            embed_in / embed_out: (V, H) the model's input and output embeddings.
            seen: (N, K) how often prev was followed by each candidate earlier in the text (`seen_after`); needed
                when the head reads the context. seen3: the same for the two tokens before the draft (order 3).
            match: (N, K) the longest match followed by each candidate (`match_lengths`), for a head with the match
                term.
        """
        terms, u = self.text_free_terms(h, prev, slot, cand, cand_logits, embed_in, embed_out)
        return self.combine(terms, slot, seen, seen3, match), u

    def text_free_terms(self, h: torch.Tensor, prev: torch.Tensor, slot: torch.Tensor, cand: torch.Tensor,
                        cand_logits: torch.Tensor, embed_in: torch.Tensor, embed_out: torch.Tensor
                        ) -> tuple[Terms, torch.Tensor]:
        """The terms of `scores` that do not read the text's own counts (each (N, K) float32), and u."""
        slot = slot.clamp(max=self.config.num_sats - 1)  # later SATs than trained share the last position's weights
        dtype = self.pair_weight.dtype
        u = self.correction(h.to(dtype), embed_in[prev].to(dtype), slot)
        mlp = torch.einsum("nkh,nh->nk", embed_out[cand].float(), u.float()) if self.config.width else None
        return Terms(cand_logits.float(), self.pair_logp(prev, cand), mlp), u

    def combine(self, terms: Terms, slot: torch.Tensor, seen: torch.Tensor | None,
                seen3: torch.Tensor | None, match: torch.Tensor | None = None) -> torch.Tensor:
        """The candidates' scores from their terms and the text's counts of pairs (`seen`) and triples (`seen3`),
        where read: z + w_j log P(c | prev) + u . E_out[c] + v_j log(1 + n) + x_j log(1 + n3) (+ the combiner's g)
        (+ the match term, on the longest matches `match`)."""
        slot = slot.clamp(max=self.config.num_sats - 1)
        if self.config.match and match is None:
            raise ValueError("this sampler head reads the text's longest matches: pass `match` (match_lengths)")
        scores = self._combined(terms, slot, seen, seen3)
        return scores + self.match_term(match, slot) if self.config.match else scores

    def match_term(self, lengths: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """m_j log(1 + max(0, L - 2)) for lengths L (N, K) and slots (N,) (already clamped): added after the
        combiner, which was trained without it."""
        return self.match_weight[slot, None].float() * match_feature(lengths)

    def _combined(self, terms: Terms, slot: torch.Tensor, seen: torch.Tensor | None,
                  seen3: torch.Tensor | None) -> torch.Tensor:
        scores = terms.z + self.pair_weight[slot, None].float() * terms.pair
        if terms.mlp is not None:
            scores = scores + terms.mlp
        counts = []
        for on, name, weight, value in ((self.config.context, "seen", self.context_weight, seen),
                                        (self.config.context3, "seen3", self.context3_weight, seen3)):
            if not on:
                counts.append(torch.zeros_like(scores))
                continue
            if value is None:
                order = ", order 3" if name == "seen3" else ""
                raise ValueError(f"this sampler head reads the context: pass `{name}` (seen_after{order})")
            counts.append(torch.log1p(value.float()))
            scores = scores + weight[slot, None].float() * counts[-1]
        if not self.config.combiner:
            return scores
        mlp = terms.mlp if terms.mlp is not None else torch.zeros_like(scores)
        features = torch.stack([terms.z - terms.z.max(-1, keepdim=True).values, terms.pair, *counts, mlp,
                                scores - scores.max(-1, keepdim=True).values], -1)  # (N, K, COMBINED_TERMS)
        dtype = self.combine_in.weight.dtype
        hidden = nn.functional.gelu(self.combine_in(features.to(dtype)) + self.combine_position[slot][:, None])
        return scores + self.combine_out(hidden)[..., 0].float()

    @torch.no_grad()
    def drafting(self, hidden: torch.Tensor, cand: torch.Tensor, cand_logits: torch.Tensor, t: int,
                 embed_in: torch.Tensor, embed_out: torch.Tensor) -> Callable[..., torch.Tensor]:
        """`scores` for a draft pass's k rows drafted in turn (in eval mode: no dropout). What does not depend on
        the token before a draft is computed here for every row at once, and the bigram term for every token a row
        may follow (t, or one of the row before's K candidates); the returned score(j, i, seen, seen3, match) gives
        row j's (1, K) scores after t (j = 0) or after candidate i of row j - 1, given the text's counts at that point
        (lists of K, `TextCounts.after_last` and `TextCounts.longest_matches`; None where the head does not read
        them), equal to `scores` up to rounding. A draft pass calls it once per draft, in sequence, so its ops are
        few: each costs about as much to set up as to run at this size (docs/results.md, "The sampler head's share
        of a draft pass"); on a CPU where the project's kernels are built, a float32 head with one hidden layer
        scores each draft in one compiled call (`native_scores`)."""
        k, top, device = *cand.shape, cand.device  # top: K
        config, slots = self.config, [min(j, self.config.num_sats - 1) for j in range(k)]
        rows = torch.tensor([0] + [j for j in range(1, k) for _ in range(top)], device=device)  # each option's row
        prevs = torch.cat([torch.tensor([t], device=device), cand[:-1].reshape(-1)])  # (1 + (k - 1) K,)
        z = cand_logits.float()  # (k, K)
        pair = self.pair_logp(prevs, cand.index_select(0, rows))  # (options, K)
        slot = torch.tensor(slots, device=device)
        w = self.pair_weight.float().index_select(0, slot).index_select(0, rows)
        base = torch.addcmul(z.index_select(0, rows), w[:, None], pair)  # z + w_j log P(c | prev)
        reads = config.context or config.context3
        count_weights = torch.stack([self.context_weight, self.context3_weight], -1).float().index_select(0, slot)
        # (k, 2): v_j and x_j; a term the head does not read gets counts of 0 below
        if config.width:
            dtype = self.pair_weight.dtype
            inp_h, inp_prev = self._split_input()
            from_h = torch.addmm(self.inp.bias + self.position.index_select(0, slot), self.norm_h(hidden.to(dtype)),
                                 inp_h.T)  # (k, MLP width): the first layer's part from the SAT's state
            cand_out = embed_out.index_select(0, cand.reshape(-1)).view(k, top, -1).float()  # (k, K, H)
            norm = self.norm_prev
        if config.combiner:
            z_gap = z - z.max(-1, keepdim=True).values
            combine_bias = self.combine_in.bias + self.combine_position.index_select(0, slot)  # (k, combiner width)
            combine_in, combine_out = self.combine_in.weight.T, self.combine_out.weight[0]
            no_counts = torch.zeros(2, top, device=device)
        prev_ids = prevs.tolist()
        # float32 weights, checked on a few (a walk over every parameter costs a draft pass tens of microseconds, and
        # .to() moves them together)
        kernel = native_scores() if config.width and config.depth == 1 and device.type == "cpu" and (
            embed_in.dtype in (torch.float32, torch.bfloat16)
            and all(w.dtype == torch.float32 for w in (self.pair_weight, self.inp.weight, self.out.weight))) else None
        if kernel is not None:  # what the compiled scores read besides each draft's own rows, once per pass
            nothing = torch.empty(0)
            combine_rows, *combined = ((combine_bias, self.combine_in.weight, combine_out.float(),
                                        float(self.combine_out.bias)) if config.combiner
                                       else (None, nothing, nothing, 0.0))

        def score(j: int, i: int, seen: list[int] | None = None, seen3: list[int] | None = None,
                  match: list[int] | None = None) -> torch.Tensor:
            scores = unmatched(j, i, seen, seen3)
            if not config.match:
                return scores
            if match is None:
                raise ValueError("this sampler head reads the text's longest matches: pass `match`")
            if max(match) <= 2:  # the term is 0 for every candidate
                return scores
            lengths = torch.tensor(match, device=device)[None]
            return scores + self.match_term(lengths, slot[j:j + 1])

        def unmatched(j: int, i: int, seen: list[int] | None, seen3: list[int] | None) -> torch.Tensor:
            at = 0 if j == 0 else 1 + (j - 1) * top + i
            for on, name, value in ((config.context, "seen", seen), (config.context3, "seen3", seen3)):
                if on and value is None:
                    raise ValueError(f"this sampler head reads the context: pass `{name}`")
            if kernel is not None:
                return kernel.head_score(
                    base[at], embed_in[prev_ids[at]], norm.weight, norm.bias, norm.eps, from_h[j], inp_prev,
                    self.out.weight, self.out.bias, cand_out[j], seen if config.context else [],
                    seen3 if config.context3 else [], count_weights[j], z_gap[j] if config.combiner else nothing,
                    pair[at] if config.combiner else nothing,
                    nothing if combine_rows is None else combine_rows[j], *combined)
            scores = base[at]
            if config.width:
                x = nn.functional.layer_norm(embed_in[prev_ids[at]].to(dtype), norm.normalized_shape, norm.weight,
                                             norm.bias, norm.eps)
                x = nn.functional.gelu(torch.addmv(from_h[j], inp_prev, x))
                for layer in self.layers:
                    x = nn.functional.gelu(layer(x))
                mlp = cand_out[j] @ torch.addmv(self.out.bias, self.out.weight, x).float()
                scores = scores + mlp
            if reads:
                # a term not read counts 0, as in `combine`
                read = [value if on else [0] * top for on, value in ((config.context, seen), (config.context3, seen3))]
                counts = torch.tensor(read, dtype=torch.float32, device=device).log1p_()  # (2, K)
                scores = torch.addmv(scores, counts.T, count_weights[j])
            if not config.combiner:
                return scores[None]
            counts = counts if reads else no_counts
            features = torch.stack([z_gap[j], pair[at], counts[0], counts[1], mlp if config.width else no_counts[0],
                                    scores - scores.max()], -1)  # (K, COMBINED_TERMS), as `combine` stacks them
            hidden_units = nn.functional.gelu(torch.addmm(combine_bias[j], features.to(combine_in.dtype), combine_in))
            return torch.addmv(scores + self.combine_out.bias.float(), hidden_units.float(), combine_out.float())[None]

        return score

    def _split_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's first layer as its two parts (from the SAT's state, from the token before), each contiguous,
        kept until the weight changes (trained, loaded or moved): a product with a strided half costs more."""
        weight, hidden_size = self.inp.weight, self.config.hidden_size
        try:
            version = weight._version
        except RuntimeError:  # made under inference_mode: such a tensor cannot change in place
            version = None
        stamp = (weight.data_ptr(), version, weight.dtype, weight.device)
        kept = getattr(self, "_split_kept", None)
        if kept is None or kept[0] != stamp:
            kept = self._split_kept = (stamp, (weight[:, :hidden_size].detach().contiguous(),
                                               weight[:, hidden_size:].detach().contiguous()))
        return kept[1]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, z: torch.Tensor, prev: torch.Tensor, slot: torch.Tensor,
               embed_in: torch.Tensor, embed_out: torch.Tensor, history: torch.Tensor | None = None,
               ends: torch.Tensor | None = None) -> torch.Tensor:
        """The head's logits (N, V) float32: the K candidates' scores, -inf elsewhere (arguments as `candidates`).
        The drafts benchmark and the acceptance trace (every row at once) go through this."""
        cand, scores = self.candidates(hidden, z, prev, slot, embed_in, embed_out, history, ends)
        return torch.full(z.shape, float("-inf"), device=z.device).scatter_(-1, cand, scores)

    @torch.no_grad()
    def candidates(self, hidden: torch.Tensor, z: torch.Tensor, prev: torch.Tensor, slot: torch.Tensor,
                   embed_in: torch.Tensor, embed_out: torch.Tensor, history: torch.Tensor | None = None,
                   ends: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's K candidates (N, K), in token order, and their scores (N, K) float32: the head's logits
        wherever they are finite.

        Args:
            hidden: (N, H) SAT rows' final hidden states; z: (N, V) their logits (the SATs' own).
            prev: (N,) the token before each draft; slot: (N,) each SAT's index j - 1 in its run.
            history: (T,) the text's tokens and ends: (N,) where each row's prev stands in it (a head that reads
                the context or its longest matches needs them).
        """
        cand_logits, cand = z.topk(self.config.candidates, dim=-1)  # (N, K) each
        cand, order = cand.sort(dim=-1)  # token order: a draw among them picks what a draw over the vocabulary would
        cand_logits = cand_logits.gather(-1, order).float()  # z's values, exact in float32
        seen = seen_after(history, ends, cand) if self.config.context else None
        seen3 = seen_after(history, ends, cand, order=3) if self.config.context3 else None
        match = match_lengths(history, ends, cand) if self.config.match and history is not None else None
        scores, _ = self.scores(hidden, prev, slot, cand, cand_logits, embed_in, embed_out, seen, seen3, match)
        return cand, scores

    def save(self, folder: str | Path) -> None:
        """float32 weights (the bigram table's keys as integers): they load back bit-exactly."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in self.state_dict().items()}, str(folder / HEAD_WEIGHTS_FILE))
        (folder / HEAD_CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "SamplerHead":
        folder = Path(folder)
        try:
            config = HeadConfig(**json.loads((folder / HEAD_CONFIG_FILE).read_text()))
            tensors = load_file(str(folder / HEAD_WEIGHTS_FILE))
        except (json.JSONDecodeError, TypeError, SafetensorError, OSError) as err:
            raise ValueError(f"sampler head in {folder} is unreadable ({err}); re-save or re-train it") from err
        head = cls(config)
        if "bigram_keys" in tensors:
            head.set_bigrams(tensors)
        for name in ("context_weight", "context3_weight", "match_weight"):  # saved before these terms existed
            tensors.setdefault(name, torch.zeros(config.num_sats))
        try:
            head.load_state_dict(tensors)
        except RuntimeError as err:
            raise ValueError(f"sampler head in {folder} does not match its {HEAD_CONFIG_FILE} ({err})") from err
        return head.eval()


def native_scores():
    """The compiled per-draft scores (csrc/head_score.cpp) where the project's kernels are built; None while they are
    not, or where SDSAT_HEAD_KERNEL=0 keeps PyTorch's ops (the same scores to float32 rounding)."""
    if os.environ.get("SDSAT_HEAD_KERNEL", "1") == "0":
        return None
    kernels = native.module()
    return kernels if hasattr(kernels, "head_score") else None


def head_beside(adapter_folder: str | Path | None) -> SamplerHead | None:
    """The sampler head saved beside a SAT adapter, or None where there is none."""
    if adapter_folder is None or not (Path(adapter_folder) / HEAD_CONFIG_FILE).is_file():
        return None
    return SamplerHead.load(adapter_folder)


def seen_after(history: torch.Tensor, ends: torch.Tensor, cand: torch.Tensor, order: int = 2) -> torch.Tensor:
    """(T,) tokens, (N,) positions in them, (N, K) candidates -> (N, K) how often the `order` - 1 tokens ending at
    each row's position were followed by each candidate before it: for order 2, pairs (history[i], history[i + 1])
    with history[i] the row's token and i + 1 <= the row's position; for order 3, the token before must match too."""
    i = torch.arange(len(history) - 1, device=history.device)  # where the matched tokens end; i + 1 follows
    after = i[None] < ends[:, None]  # (N, T - 1)
    for back in range(order - 1):  # history[i - back] == history[end - back], both inside the text
        here, there = i - back, ends - back
        same = history[here.clamp(min=0)][None] == history[there.clamp(min=0)][:, None]
        after = after & same & (here >= 0)[None] & (there >= 0)[:, None]
    return ((history[1:][None, None] == cand[:, :, None]) & after[:, None]).sum(-1)  # (N, K)


def match_feature(lengths: torch.Tensor) -> torch.Tensor:
    """The match term's value for longest matches L: log(1 + max(0, L - 2)), 0 up to the triples' two tokens."""
    return torch.log1p((lengths.float() - 2).clamp(min=0))


def match_lengths(history: torch.Tensor, ends: torch.Tensor, cand: torch.Tensor, cap: int = MATCH_CAP,
                  rows: int = 256) -> torch.Tensor:
    """(T,) tokens, (N,) positions in them, (N, K) candidates -> (N, K) for each candidate c the longest L <= cap
    such that the L tokens ending at the row's position were followed by c earlier: history[i - L + 1 .. i] ==
    history[end - L + 1 .. end] and history[i + 1] == c, for i + 1 <= end (0 where c never followed the row's
    token). `rows` rows at a time bound the memory."""
    out = torch.zeros(cand.shape, dtype=torch.long, device=cand.device)
    if len(history) < 2:  # nothing came before anything
        return out
    i = torch.arange(len(history) - 1, device=history.device)  # aligned with the row's end; i + 1 follows
    for first in range(0, len(ends), rows):
        end = ends[first:first + rows]
        run = (i[None] < end[:, None]).long()  # (n, T - 1): still matching, back to `back` tokens
        length = torch.zeros_like(run)
        for back in range(cap):
            here, there = i - back, end - back
            same = history[here.clamp(min=0)][None] == history[there.clamp(min=0)][:, None]
            run = run * (same & (here >= 0)[None] & (there >= 0)[:, None])
            if not run.any():
                break
            length += run
        follows = history[1:][None, None] == cand[first:first + rows, :, None]  # (n, K, T - 1)
        out[first:first + rows] = (length[:, None] * follows).amax(-1)
    return out


class TextCounts:
    """How often each pair and triple of tokens occurs in a growing text, for those that end in one of the
    `wanted` tokens: `seen_after` at the text's last token, counted once per draft pass instead of once per draft;
    and where each triple followed by a wanted token ended (`after_triple`), from which `longest_matches` extends
    the text's last triple backwards."""

    def __init__(self, text: list[int], wanted: torch.Tensor, matches: bool = False):
        self.text, self.matches = list(text), matches  # matches: keep `after_triple`, for `longest_matches`
        self.pairs, self.triples = Counter(), Counter()
        self.after_triple: dict[tuple[int, int, int], list[int]] = {}  # a triple -> where it ended, a wanted token next
        wanted = set(wanted.flatten().tolist())  # a draft pass's few hundred tokens: Python's loop beats tensors' setup
        for end in range(1, len(self.text)):
            if self.text[end] in wanted:
                self._count(end)

    def _count(self, end: int) -> None:
        text = self.text
        self.pairs[text[end - 1], text[end]] += 1
        if end >= 2:
            self.triples[text[end - 2], text[end - 1], text[end]] += 1
        if self.matches and end >= 3:
            self.after_triple.setdefault((text[end - 3], text[end - 2], text[end - 1]), []).append(end - 1)

    def append(self, token: int) -> None:
        self.text.append(token)
        self._count(len(self.text) - 1)

    def after_last(self, cand: list[int]) -> tuple[list[int], list[int]]:
        """How often the last token, and the last two, were followed by each of `cand` (wanted tokens) so far."""
        prev = self.text[-1]
        prev2 = self.text[-2] if len(self.text) > 1 else None
        return ([self.pairs.get((prev, c), 0) for c in cand], [self.triples.get((prev2, prev, c), 0) for c in cand])

    def longest_matches(self, cand: list[int], cap: int = MATCH_CAP) -> list[int]:
        """`match_lengths` at the text's last token, for matches of three tokens or more (the only ones the match
        term reads; shorter ones are given as 0): each earlier end of the last triple is extended backwards."""
        text, last = self.text, len(self.text) - 1
        best: dict[int, int] = {}
        if last >= 2:
            for at in self.after_triple.get((text[last - 2], text[last - 1], text[last]), ()):
                length = 3
                while length < cap and at - length >= 0 and text[at - length] == text[last - length]:
                    length += 1
                follower = text[at + 1]
                if best.get(follower, 0) < length:
                    best[follower] = length
        return [best.get(c, 0) for c in cand]


def head_drafts(head: SamplerHead, hidden: torch.Tensor, logits: torch.Tensor, t: int, embed_in: torch.Tensor,
                embed_out: torch.Tensor, warp, draw, history: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts 1..k in turn, each conditioned on the one before it (draft 1 on t).

    Args:
        hidden: (k, H) the SAT rows' final hidden states; logits: (k, V) their logits z.
        warp: (N, W) logits -> (N, W) the sampler's distribution (TokenChooser.probs), here over K candidates;
        draw: (N, W) distributions -> (N,) positions in the row (TokenChooser.draw).
        history: every token before t (a head that reads the context counts its pairs and triples, and finds its
            longest matches).
    Returns q (k, V), each row the exact distribution its draft was drawn from, and the drafts (k,).

    The head's logits are -inf outside its K candidates, so each draft is warped and drawn among those K alone (the
    warps and draws keep a row's order, and the candidates are in token order): the vocabulary-wide row a draw
    would otherwise cost is only written out for q. What does not depend on the draws is computed once for
    all k rows (`SamplerHead.drafting`, `TextCounts`); the loop adds what does, and equals `SamplerHead.candidates`
    row by row up to rounding.
    """
    k, device = len(hidden), logits.device
    cand_logits, cand = logits.topk(head.config.candidates, dim=-1)  # (k, K) each
    cand, order = cand.sort(dim=-1)  # token order, as `candidates`
    cand_logits = cand_logits.gather(-1, order).float()
    score = head.drafting(hidden, cand, cand_logits, t, embed_in, embed_out)
    reads_text = head.config.context or head.config.context3 or head.config.match
    counts = TextCounts(list(history) + [t], cand, matches=head.config.match) if reads_text else None
    q = torch.zeros(logits.shape, device=device)
    candidates, drafts, prev = cand.tolist(), [], 0  # prev: t (0), else the index of the draft before among its K
    for j in range(k):
        seen, seen3 = counts.after_last(candidates[j]) if reads_text else (None, None)
        scores = score(j, prev, seen, seen3,
                       match=counts.longest_matches(candidates[j]) if head.config.match else None)
        q_cand = warp(scores)  # (1, K)
        prev = int(draw(q_cand)[0])
        drafts.append(candidates[j][prev])
        if reads_text:
            counts.append(drafts[-1])
        q[j].scatter_(-1, cand[j], q_cand[0])
    return q, torch.tensor(drafts, device=device)
