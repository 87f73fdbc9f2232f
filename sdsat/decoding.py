"""Decoders: vanilla autoregressive decoding and SDSAT's draft-then-verify loop.

Every decoder is a generator that yields one `StepRecord` per iteration and then one
`GenerationResult`, so the app can stream and the benchmark can drain them alike. The KV cache is a
transformers `DynamicCache` owned by the decoder (`kvcache.new_cache`); only `kvcache.py` shrinks it or moves its rows.

SDSAT iteration (paper, section 3.3), with `pending` the tokens not yet in the cache:
  1. propose: a drafter (drafters.py) gives candidates. The paper's: feed [pending, SAT x k]; the
     logits at the last pending token give t, which is what vanilla decoding would emit, and the
     logits at SAT j give draft d_{j+1} (the draft pass). Prompt lookup may copy instead, a draft
     tree adds runner-ups, the fused scheme drafts inside the previous verify pass.
  2. verify: feed [t, d_1..d_k] (verify.py). Keep the longest prefix of drafts the model agrees with,
     plus the model's own next token (the bonus), which becomes `pending`.
Greedy output is identical to vanilla decoding; sampled output has the same distribution.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .config import MAX_LOOKUP_TOKENS, METHODS, SCHEMES, DecodeConfig
from .drafters import DraftContext, Proposal, drafter_for
from .kvcache import new_cache
from .prompts import StopChecker
from .records import Event, GenerationResult, StepRecord, collect
from .sampling import TokenChooser
from .sat import SatModel, call_with_cache
from .timing import Clock
from .tree import MAX_EXTRA as MAX_TREE_CANDIDATES
from .verify import Verdict, verify_chain, verify_tree

__all__ = ["DecodeConfig", "Event", "GenerationResult", "MAX_LOOKUP_TOKENS", "MAX_TREE_CANDIDATES", "METHODS",
           "SCHEMES", "StepRecord", "collect", "decode"]



def decode(sat_model: SatModel | torch.nn.Module, tokenizer, prompt_ids: list[int], config: DecodeConfig,
           eos_ids: list[int], should_stop=None) -> Iterator[Event]:
    """Run one request; yields a StepRecord per iteration, then the GenerationResult.

    Args:
        sat_model: a SatModel (required for SDSAT) or a plain causal LM (vanilla only).
        prompt_ids: the encoded prompt, at least one token.
        eos_ids: ids that end the output (included in it, as `model.generate` does).
        should_stop: optional callable checked between iterations; True cancels the request and
            the result so far is returned with stop_reason "cancelled".
    """
    config.validate(max_k=sat_model.max_k if isinstance(sat_model, SatModel) else None)
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    model = sat_model.model if isinstance(sat_model, SatModel) else sat_model
    config.check_context(len(prompt_ids), getattr(model.config, "max_position_embeddings", None))
    stop = StopChecker(tokenizer, eos_ids, config.max_new_tokens, config.stop_strings)
    decoder = _vanilla if config.method == "vanilla" else _sdsat
    return decoder(sat_model, model, prompt_ids, config, stop, should_stop or (lambda: False), tokenizer)


def _vanilla(sat_model, model, prompt_ids, config, stop: StopChecker, should_stop, tokenizer) -> Iterator[Event]:
    device = next(model.parameters()).device
    chooser = TokenChooser(config.sampling, device)
    cache, clock, steps = new_cache(model.config), Clock(device), []
    pending = prompt_ids
    with torch.inference_mode():
        while True:
            kv_before, t0 = cache.get_seq_length(), clock.now()
            logits = call_with_cache(model, cache, input_ids=torch.tensor([pending], device=device),
                                     logits_to_keep=1).logits
            tokens, probs = chooser.choose(logits[0, -1:])
            t1 = clock.now()
            token = int(tokens[0])
            done = stop.add(token)
            steps.append(StepRecord(index=len(steps), kind="vanilla", kv_len_before=kv_before, draft_pass=False, k=0,
                                    drafts=[], draft_probs=[], predictions=[], accepted=0, tokens=[token],
                                    sources=["verified"], probs=[float(probs[0])], pass_seconds=[t1 - t0],
                                    kv_len=cache.get_seq_length(), elapsed=t1 - clock.start))
            yield steps[-1]
            if done or should_stop():
                break
            pending = [token]
    yield _result(config, 0, prompt_ids, stop, steps, clock, tokenizer)


def _sdsat(sat_model: SatModel, model, prompt_ids, config, stop: StopChecker, should_stop,
           tokenizer) -> Iterator[Event]:
    chooser = TokenChooser(config.sampling, sat_model.device)
    cache, clock, steps = new_cache(model.config), Clock(sat_model.device), []
    drafter = drafter_for(config)
    pending, history = list(prompt_ids), list(prompt_ids)  # not yet in the cache; every token so far
    with torch.inference_mode():
        while True:
            kv_before = cache.get_seq_length()
            # 1. Propose candidates (a draft pass, when the drafter runs one, also gives the certain token t).
            room = config.max_new_tokens - (len(history) - len(prompt_ids)) - 1
            proposal = drafter.propose(DraftContext(sat_model, chooser, cache, pending, history, room, clock))
            # 2. Verify them in one pass; the cache keeps the start token and the accepted drafts.
            t0 = clock.now()
            if proposal.tree is not None:
                verdict = verify_tree(sat_model, chooser, cache, proposal.start, proposal.drafts, proposal.tree,
                                      proposal.q, proposal.draws, proposal.valid)
            else:
                verdict = verify_chain(sat_model, chooser, cache, proposal.start, proposal.drafts, proposal.q,
                                       proposal.draft_next)
            t1 = clock.now()
            # 3. Emit t, the accepted drafts and the bonus, cut where vanilla decoding would stop.
            emitted, sources, probs = _emitted(proposal, verdict)
            emitted, sources, probs, done = _cut_at_stop(stop, emitted, sources, probs)
            passes = ([proposal.draft_pass_seconds] if proposal.draft_pass_seconds is not None else []) + [t1 - t0]
            # A test at depth d decided the token d places after t: those past the stop decided nothing shown.
            tests = [test for test in verdict.tests if test.depth <= len(emitted) - len(proposal.certain)]
            steps.append(_record(len(steps), kv_before, proposal, verdict, emitted, sources, probs, passes,
                                 cache.get_seq_length(), t1 - clock.start, tests))
            yield steps[-1]
            if done or should_stop():
                break
            # 4. Let the drafter learn from the outcome, and continue from the bonus token.
            drafter.observe(proposal, verdict)
            history += emitted
            pending = [verdict.bonus]
    yield _result(config, config.k, prompt_ids, stop, steps, clock, tokenizer)


def _emitted(proposal: Proposal, verdict: Verdict) -> tuple[list[int], list[str], list[float]]:
    """The iteration's tokens before any stop: t (if a draft pass gave it), the accepted drafts, the bonus."""
    a, p = verdict.accepted, verdict.p
    tokens = proposal.certain + verdict.shown[:a] + [verdict.bonus]
    sources = ["verified"] * len(proposal.certain) + ["draft"] * a + ["bonus"]
    probs = proposal.certain_probs + [float(p[i, verdict.shown[i]]) for i in range(a)] + [float(p[a, verdict.bonus])]
    return tokens, sources, probs


def _record(index: int, kv_before: int, proposal: Proposal, verdict: Verdict, tokens, sources, probs,
            pass_seconds: list[float], kv_len: int, elapsed: float, tests: list) -> StepRecord:
    shown, q = verdict.shown, proposal.q
    if q is None:  # copies
        draft_probs = [1.0] * len(shown)
    else:
        draft_probs = q[torch.arange(len(shown)), torch.tensor(shown, device=q.device)].tolist()
    tree = proposal.tree
    ranks = [proposal.ranks[i] for i in verdict.shown_rows] if tree else proposal.ranks[:len(shown)]
    return StepRecord(
        index=index, kind=proposal.kind, kv_len_before=kv_before, draft_pass=proposal.draft_pass_seconds is not None,
        k=proposal.k, drafts=shown, draft_probs=draft_probs, predictions=verdict.p.argmax(-1).tolist(),
        accepted=verdict.accepted, tokens=tokens, sources=sources, probs=probs, pass_seconds=pass_seconds,
        kv_len=kv_len, elapsed=elapsed, draft_ranks=ranks, candidates=len(proposal.drafts),
        tree_paths=[list(path) for path in tree.paths] if tree else [], tree_tokens=verdict.node_tokens,
        accept_tests=tests, conditioned=proposal.conditioned)


def _cut_at_stop(stop: StopChecker, tokens: list[int], sources: list[str], probs: list[float]):
    """Feed tokens to the stop checker; cut them (and their sources / probs) after the last one."""
    for count, token in enumerate(tokens, 1):
        if stop.add(token):
            return tokens[:count], sources[:count], probs[:count], True
    return tokens, sources, probs, False


def _result(config, k, prompt_ids, stop: StopChecker, steps, clock: Clock, tokenizer) -> GenerationResult:
    return GenerationResult(
        method=config.method, k=k, prompt_ids=list(prompt_ids), token_ids=list(stop.tokens),
        text=tokenizer.decode(stop.tokens, skip_special_tokens=True), seconds=clock.elapsed(),
        prefill_seconds=steps[0].pass_seconds[0] if steps else 0.0, stop_reason=stop.reason or "cancelled",
        steps=steps)
