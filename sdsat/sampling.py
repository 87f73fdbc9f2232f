"""Token choice: greedy, sampling (transformers' temperature and top-k warpers, a partial-sort top-p), and
speculative acceptance.

Names follow the speculative-sampling papers: `p` is the target model's distribution at a position
(what vanilla sampling would draw from), `q` the distribution the SAT drafted from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .errors import check_real, check_whole
from .records import AcceptTest

# Below this, logits / temperature overflow float32 (1e-40 gives inf - inf = NaN probabilities); 0.01
# already makes sampling all but greedy, so nothing useful lies beneath it.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 5.0  # higher ones give near-random text
MAX_TOP_K = 1000
MAX_SEED = 2**31 - 1
RESIDUAL_SHOWN = 5  # a rejection's residual distribution: this many of its top tokens are recorded
NUCLEUS_CANDIDATES = 256  # top-p looks for the nucleus among this many top tokens before sorting a whole row
WIDE_NUCLEUS_CANDIDATES = 4096  # and then among this many: a partial sort of them costs a seventh of a whole
# row's sort on a 49k vocabulary (AMD EPYC, 1 thread: 0.5 ms against 3.5 ms). SmolLM2-135M's nuclei at top-p
# 0.95 on 3 prompts: at T 0.7 all within 256 tokens (max 80); at T 1, 7% between 257 and 4096, none wider


@dataclass
class SamplingConfig:
    """How tokens are chosen; greedy unless do_sample."""

    do_sample: bool = False  # False: argmax (greedy); True: sample with the settings below
    temperature: float = 1.0  # in [MIN_TEMPERATURE, MAX_TEMPERATURE]; only used when sampling
    top_p: float = 1.0  # in (0, 1]; 1 keeps every token
    top_k: int = 0  # 0..MAX_TOP_K; 0 keeps every token
    seed: int | None = None  # 0..MAX_SEED, seeds the sampler; None draws a fresh seed

    def validate(self) -> None:
        """Raise ValueError naming the first setting out of its range; greedy ignores (and skips) them all."""
        if not self.do_sample:
            return
        check_real("temperature", self.temperature, MIN_TEMPERATURE, MAX_TEMPERATURE)
        check_real("top_p", self.top_p, 0, 1, low_open=True)
        check_whole("top_k", self.top_k, 0, MAX_TOP_K, off=True)
        if self.seed is not None:
            check_whole("seed", self.seed, 0, MAX_SEED)


class PartialSortTopP:
    """Top-p (nucleus) filtering with transformers' TopPLogitsWarper's rule, without sorting the whole row.

    A token is kept when the probability of the tokens ranked above it is below top_p (so the top token
    always is). That rule reads only the top tokens: when the nucleus ends within the NUCLEUS_CANDIDATES
    highest logits, a partial sort of them decides it; rows whose nucleus is wider try the
    WIDE_NUCLEUS_CANDIDATES highest, and rows wider still go to transformers' warper, which sorts them whole
    (docs/architecture.md, "Sampling cost"). Where tied logits or float
    rounding decide the nucleus's edge, the two may keep a different token; p, q and vanilla sampling all
    go through this one, so sampling stays exact.
    """

    def __init__(self, top_p: float):
        self.top_p = top_p
        self.whole_rows = TopPLogitsWarper(top_p)

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        """(N, V) logits -> (N, V) the same logits, -inf outside each row's nucleus; `input_ids` is unused."""
        out, wider = self._within(scores, NUCLEUS_CANDIDATES)
        if bool(wider.any()):  # the nucleus may go on past the candidates
            more, wider_still = self._within(scores[wider], WIDE_NUCLEUS_CANDIDATES)
            if bool(wider_still.any()):
                more[wider_still] = self.whole_rows(None, scores[wider][wider_still])
            out[wider] = more
        return out

    def _within(self, scores: torch.Tensor, candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, V) logits -> (the logits, -inf outside each row's nucleus among its `candidates` highest; (N,) True
        where the nucleus may go on past them, so that row is not decided yet)."""
        vocabulary = scores.shape[-1]
        top = scores.topk(min(candidates, vocabulary), dim=-1)  # (N, m), highest first
        probs = (top.values - scores.logsumexp(-1, keepdim=True)).exp()
        keep = probs.cumsum(-1) - probs < self.top_p  # mass above each candidate below top_p: a prefix
        kept = top.values.masked_fill(~keep, float("-inf"))
        out = torch.full_like(scores, float("-inf")).scatter_(-1, top.indices, kept)
        wider = keep.all(-1) if top.values.shape[-1] < vocabulary else torch.zeros_like(keep[:, 0])
        return out, wider


def _cumulative(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V) probabilities -> (them, their cumulative sums), in float64 (on the CPU where the device has no
    float64); raises ValueError for a row without mass, which no draw can come from."""
    wide = probs.to("cpu" if probs.device.type == "mps" else probs.device, torch.float64)
    cumulative = wide.cumsum(-1)
    total = cumulative[..., -1]
    if not bool(torch.isfinite(total).all()) or bool((total <= 0).any()) or bool((wide < 0).any()):
        raise ValueError("cannot draw from a distribution whose probabilities are negative, NaN or all zero")
    return wide, cumulative


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(N, V) probabilities (not necessarily normalised) and (N,) numbers in [0, 1) -> (N,) for each row the
    first token whose cumulative sum exceeds u times the row's total. With u uniform that is a draw from
    the row, exact up to float64 rounding; torch.multinomial draws an exponential number per token instead,
    several times slower on a large vocabulary (docs/architecture.md, "Sampling cost")."""
    wide, cumulative = _cumulative(probs)  # (N, V) each
    u = u.to(cumulative.device, torch.float64)
    tokens = torch.searchsorted(cumulative, (u * cumulative[:, -1])[:, None], right=True).squeeze(-1)
    tokens = tokens.clamp(max=probs.shape[-1] - 1)  # u * total rounded up to the total
    empty = wide.gather(-1, tokens[:, None]).squeeze(-1) <= 0
    if bool(empty.any()):  # rounding landed past the row's last token with mass: that token is meant
        last = wide.shape[-1] - 1 - (wide.flip(-1) > 0).int().argmax(-1)
        tokens = torch.where(empty, last, tokens)
    return tokens


def draws_without_replacement(row: torch.Tensor, u: torch.Tensor) -> list[int]:
    """(V,) probabilities and (n,) numbers in [0, 1) -> n distinct tokens: the i-th is `inverse_cdf` of the
    row without the tokens before it, at u[i]. With u uniform these are successive draws without
    replacement, which is what tree siblings need (docs/architecture.md, "Sampling a tree")."""
    wide, cumulative = (t[0].cpu() for t in _cumulative(row[None]))  # (V,) each
    start = torch.cat([cumulative.new_zeros(1), cumulative[:-1]])
    total, drawn = float(cumulative[-1]), []
    for ui in u.tolist():
        target = ui * (total - sum(float(cumulative[x] - start[x]) for x in drawn))
        for x in sorted(drawn):  # step over each drawn token's interval once the target has reached it
            if target >= float(start[x]):
                target += float(cumulative[x] - start[x])
        token = min(int(torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64), right=True)),
                    len(cumulative) - 1)
        if token in drawn or wide[token] <= 0:  # rounding at an interval's edge, or a mass too small to count
            left = wide > 0
            left[drawn] = False
            token = int(left.nonzero()[-1])
        drawn.append(token)
    return drawn


class TokenChooser:
    """Turns logits into tokens for one request: greedy argmax or seeded sampling."""

    def __init__(self, config: SamplingConfig, device: torch.device):
        config.validate()
        self.config = config
        # A plain list: LogitsProcessorList inspects every warper's signature at each call.
        self.warpers: list = []
        if config.do_sample:
            if config.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k > 0:
                self.warpers.append(TopKLogitsWarper(config.top_k))
            if config.top_p < 1.0:
                self.warpers.append(PartialSortTopP(config.top_p))
        # MPS has no float64 uniforms, which the draws need: its sampler's numbers come from the CPU.
        self.generator = torch.Generator(device="cpu" if torch.device(device).type == "mps" else device)
        if config.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(config.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, V) logits -> (N, V) probabilities after temperature / top-k / top-p (float32)."""
        logits = logits.float()
        for warper in self.warpers:
            logits = warper(None, logits)  # these warpers ignore input_ids
        return torch.softmax(logits, dim=-1)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, V) logits -> (tokens (N,), their probabilities (N,)); greedy or sampled."""
        probs = self.probs(logits)
        tokens = self.draw(probs)
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1)

    def draw(self, q: torch.Tensor) -> torch.Tensor:
        """(N, V) distributions -> (N,) one token per row: drawn (`inverse_cdf`) when sampling, else the top one."""
        if self.config.do_sample:
            return inverse_cdf(q, self._uniform(len(q))).to(q.device)
        return q.argmax(-1)

    def _uniform(self, n: int) -> torch.Tensor:
        """(n,) float64 numbers uniform in [0, 1), from this request's generator."""
        return torch.rand(n, generator=self.generator, device=self.generator.device, dtype=torch.float64)

    def draw_ranked(self, q: torch.Tensor, count: int) -> tuple[torch.Tensor, list[int]]:
        """(depth, V) draft distributions -> ((depth, count) tokens, per row how many are real draws).

        Greedy: each row's `count` most likely tokens. Sampling: `count` draws without replacement, in the
        order drawn, which is the order verification must try them in. Where q's support (after top-k /
        top-p) holds fewer tokens, only that many are drawn; the rest of the row repeats its first draw
        and is never tried.
        """
        if not self.config.do_sample:
            return q.topk(count, dim=-1).indices, [count] * len(q)
        valid = (q > 0).sum(-1).clamp(max=count).tolist()
        rows = []
        for row, n in zip(q, valid):
            drawn = draws_without_replacement(row, self._uniform(n))
            rows.append(drawn + drawn[:1] * (count - n))
        return torch.tensor(rows, device=q.device), valid

    def try_siblings(self, p: torch.Tensor, q: torch.Tensor, draws: list[int], ranks: list[int],
                     depth: int) -> tuple[int | None, int | None, list[AcceptTest]]:
        """Multi-draft speculative sampling at one position (docs/architecture.md derives it).

        Args:
            p: (V,) the model's distribution here.
            q: (V,) the distribution the drafts here were drawn from, without replacement, in `draws`' order.
            draws: the tokens drawn here, in order; `ranks`: the ones the tree verified (ascending).
        The sibling of rank r is accepted with probability min(1, r(x) / q_r(x)), where q_r is q without the
        r tokens drawn before it (what x was drawn from) and r(x) is what earlier rejections left of p: each
        rejection replaces it by norm(max(0, r - q_r)). Stopping before the last sibling and drawing from the
        residual is exact too (what the remaining tries would give is distributed as it). Returns (the index in
        `ranks` of the accepted sibling, or None and the token drawn from the last residual), and each try's
        numbers.
        """
        residual, tests = p, []
        for i, rank in enumerate(ranks):
            proposal = q
            if rank:  # q without the siblings drawn before this one
                proposal = q.clone()
                proposal[draws[:rank]] = 0
                total = proposal.sum()
                if total <= 0:
                    break
                proposal /= total
            x = draws[rank]
            px, qx = float(residual[x]), float(proposal[x])
            if qx <= 0:  # a draw q gives no mass (float rounding at low temperatures): stopping here stays exact
                break
            u = float(self._uniform(1))
            tests.append(AcceptTest(depth=depth, token=x, p=px, q=qx, u=u, accepted=u * qx < px, rank=rank))
            if tests[-1].accepted:
                return i, None, tests
            left = (residual - proposal).clamp(min=0)
            if left.sum() > 0:  # else residual == proposal up to rounding: any draw from it is exact
                residual = left / left.sum()
            top = residual.topk(min(RESIDUAL_SHOWN, residual.shape[-1]))
            tests[-1].residual = [(int(t), float(v)) for v, t in zip(top.values, top.indices) if v > 0]
        token = self.sample(residual)
        if tests:
            tests[-1].replacement = token
        return None, token, tests

    def sample(self, p: torch.Tensor) -> int:
        """One token drawn from the distribution p (V,)."""
        return int(self.draw(p[None])[0])

    def accept(self, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int, list[AcceptTest]]:
        """Verify a chain of drafts against the model; returns (accepted drafts, the model's next token, the
        accept tests when sampling).

        Args:
            p: (k + 1, V) model distributions; row i follows the i-th draft (row 0 follows t).
            q: (k, V) draft distributions; row i produced drafts[i].
            drafts: (k,) drafted tokens.
        Greedy: the longest prefix equal to argmax p, then argmax p after it. Sampling: accept
        draft i with probability min(1, p_i / q_i); at the first rejection draw from the normalised
        residual max(0, p_i - q_i); after full acceptance draw from p_k. This keeps the output
        distribution exactly that of sampling from p.
        """
        k = drafts.shape[0]
        if not self.config.do_sample:
            matches = (p[:k].argmax(-1) == drafts).int()
            accepted = int(matches.cumprod(0).sum())
            return accepted, int(p[accepted].argmax()), []
        tests = []
        for i, x in enumerate(drafts.tolist()):
            taken, token, tried = self.try_siblings(p[i], q[i], [x], [0], depth=i + 1)
            tests += tried
            if taken is None:
                return i, token, tests
        return k, self.sample(p[k]), tests
