"""Token choice: greedy, sampling through transformers' logits processors, and speculative acceptance.

Names follow the speculative-sampling papers: `p` is the target model's distribution at a position
(what vanilla sampling would draw from), `q` the distribution the SAT drafted from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .errors import check_real, check_whole

# Below this, logits / temperature overflow float32 (1e-40 gives inf - inf = NaN probabilities); 0.01
# already makes sampling all but greedy, so nothing useful lies beneath it.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 5.0  # higher ones give near-random text
MAX_TOP_K = 1000
MAX_SEED = 2**31 - 1


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


class TokenChooser:
    """Turns logits into tokens for one request: greedy argmax or seeded sampling."""

    def __init__(self, config: SamplingConfig, device: torch.device):
        config.validate()
        self.config = config
        self.warpers = LogitsProcessorList()
        if config.do_sample:
            if config.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k > 0:
                self.warpers.append(TopKLogitsWarper(config.top_k))
            if config.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(config.top_p))
        self.generator = torch.Generator(device=device)
        if config.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(config.seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, V) logits -> (N, V) probabilities after temperature / top-k / top-p (float32)."""
        logits = logits.float()
        if self.warpers:
            logits = self.warpers(None, logits)  # these warpers ignore input_ids
        return torch.softmax(logits, dim=-1)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, V) logits -> (tokens (N,), their probabilities (N,)); greedy or sampled."""
        probs = self.probs(logits)
        if self.config.do_sample:
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        else:
            tokens = probs.argmax(-1)
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1)

    def draw(self, q: torch.Tensor) -> torch.Tensor:
        """(k, V) draft distributions -> (k,) drafts: sampled when sampling, else each row's top token."""
        if self.config.do_sample:
            return torch.multinomial(q, 1, generator=self.generator).squeeze(-1)
        return q.argmax(-1)

    def accept(self, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
        """Verify drafts against the model; returns (accepted drafts, the model's next token).

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
            return accepted, int(p[accepted].argmax())
        idx = torch.arange(k, device=p.device)
        ratio = p[idx, drafts] / q[idx, drafts]  # q[i, drafts[i]] > 0: drafts were drawn from q
        u = torch.rand(k, generator=self.generator, device=p.device)
        for i in range(k):
            if u[i] >= ratio[i]:  # reject with probability 1 - min(1, p/q)
                residual = (p[i] - q[i]).clamp(min=0)
                if residual.sum() <= 0:  # p == q up to rounding: any draw from p is exact
                    residual = p[i]
                token = torch.multinomial(residual / residual.sum(), 1, generator=self.generator)
                return i, int(token)
        token = torch.multinomial(p[k], 1, generator=self.generator)
        return k, int(token)
