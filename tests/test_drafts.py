"""Acceptance of SAT drafts along vanilla's greedy output (`python -m sdsat.bench.drafts`): the learning
curve's measure."""

from __future__ import annotations

import json

import pytest

from sdsat.bench.drafts import cumulative_acceptance, main, measure
from sdsat.engine import DEFAULT_ADAPTER
from sdsat.sat import AdapterConfig, SatAdapter


def test_a_draft_counts_only_when_every_draft_before_it_matched():
    ranks = [[0, 0, 0], [0, 2, 0], [1, 0, 0], [0, 0, 5], [0, 0], [0]]  # the last two end past the output
    acceptance, passes = cumulative_acceptance(ranks, 3)
    assert passes == 4 and acceptance == [3 / 4, 2 / 4, 1 / 4]
    assert cumulative_acceptance([[0]], 3) == ([0.0, 0.0, 0.0], 0)


def test_the_shipped_sats_are_accepted_and_untrained_ones_are_not(default_engine, tmp_path):
    from sdsat.bench.prompts import humaneval_prompts

    config = AdapterConfig(**json.loads((DEFAULT_ADAPTER / "adapter_config.json").read_text()))
    untrained = SatAdapter.for_model(default_engine.model, config)
    untrained.save(tmp_path / "untrained")
    results = measure(default_engine, [DEFAULT_ADAPTER, tmp_path / "untrained"],
                      {"he": humaneval_prompts("16-17")}, k=3, max_new_tokens=24, sampled=((0.01, 1.0),))["he"]
    shipped, fresh = results["acceptance"][str(DEFAULT_ADAPTER)], results["acceptance"][str(tmp_path / "untrained")]
    assert results["passes"] > 30
    assert shipped[0] >= shipped[1] >= shipped[2] and shipped[0] > 0.4, shipped
    assert shipped[0] > fresh[0] + 0.2 and shipped[1] > fresh[1] + 0.1, (shipped, fresh)
    assert default_engine.sat_model.adapter is not None  # the engine's own SATs are still in place
    # The one-pass draft passes agree with the decoder's own, one position at a time.
    from sdsat.bench.acceptance import ranks_along
    from sdsat.config import DecodeConfig

    ranks = []
    for prompt in humaneval_prompts("16-17"):
        ids = default_engine.encode(prompt.text)
        out = default_engine.generate(prompt.text, DecodeConfig(method="vanilla", max_new_tokens=24)).token_ids
        ranks += ranks_along(default_engine.sat_model, ids, out, 3)
    assert cumulative_acceptance(ranks, 3)[0] == pytest.approx(shipped, abs=0.03)
    # Near T = 0 the accept test is the greedy comparison: a draft passes when it is the model's argmax, so
    # the sampled rates equal greedy acceptance (the same outputs, the same positions: the alignment holds).
    cold = results["sampled 0.01,1"]
    assert cold["passes"] == results["passes"]
    for folder in (str(DEFAULT_ADAPTER), str(tmp_path / "untrained")):
        assert cold["acceptance"][folder] == pytest.approx(results["acceptance"][folder], abs=0.03)


@pytest.mark.parametrize("args, message", [
    (["/nonexistent"], "/nonexistent is not a SAT adapter folder (no adapter_config.json)"),
    ([str(DEFAULT_ADAPTER), "--k", "0"], "k must be at least 1, got 0"),
])
def test_bad_input_is_one_line(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_the_acceptance_trace_of_chat_prompts_is_taken_under_the_chat_template(default_engine, tmp_path, monkeypatch):
    """`python -m sdsat.bench.acceptance --prompts FILE`: a chat prompt is decoded as the Chat tab decodes it,
    greedy and sampled, so the trace holds the chat-templated prompt and the output that follows it."""
    from sdsat.bench import acceptance
    from sdsat.config import DecodeConfig
    from sdsat.engine import Engine
    from sdsat.planner import Trace

    decodes = []  # (sampled, chat) of every decode the tool runs
    generate = Engine.generate

    def spied(self, prompt, config, chat=False):
        decodes.append((config.sampling.do_sample, chat))
        return generate(self, prompt, config, chat)

    monkeypatch.setattr(Engine, "generate", spied)

    text = "Name two colours."
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": text, "kind": "chat"}) + "\n")
    out = tmp_path / "trace.json"
    assert acceptance.main(["--prompts", str(tmp_path / "chat.jsonl"), "--max-new-tokens", "6",
                            "--out", str(out)]) == 0
    trace = Trace.load(out)
    (prompt,) = trace.prompts
    assert prompt.prompt_ids == default_engine.encode(text, chat=True) != default_engine.encode(text)
    want = default_engine.generate(text, DecodeConfig(method="vanilla", max_new_tokens=6), chat=True).token_ids
    assert prompt.output_ids == want and len(prompt.ranks) == len(want)
    assert "--prompts" in trace.source and len(trace.sampled) == len(acceptance.SAMPLED)
    # each setting keeps its sampled output of the prompt: the planner finds prompt lookup's copies there
    assert all(len(s.outputs) == 1 and 0 < len(s.outputs[0]) <= 6 for s in trace.sampled)
    # --sampled-only pairs output i with the kept trace's prompt i: other prompts are refused, the trace kept
    (tmp_path / "other.jsonl").write_text(json.dumps({"prompt": "Name two fruits.", "kind": "chat"}) + "\n")
    before = out.read_text()
    with pytest.raises(SystemExit) as exit_:
        acceptance.main(["--prompts", str(tmp_path / "other.jsonl"), "--sampled-only", "--out", str(out)])
    assert exit_.value.code == 2 and out.read_text() == before
    assert sorted(set(decodes)) == [(False, True), (True, True)]
    # A prompt file that cannot be read is refused before the model loads.
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit) as exit_:
        acceptance.main(["--prompts", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "other.json")])
    assert exit_.value.code == 2 and not (tmp_path / "other.json").exists()
