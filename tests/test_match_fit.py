"""The match term's fit (sdsat/train/match.py): a coordinate search over a grid on decoding's own count."""

from __future__ import annotations

import pytest
import torch

from sdsat.train.match import expected_drafts, fit, main, rows_along, trace_outputs


def rows_with_a_window() -> list[dict[str, torch.Tensor]]:
    """Two runs of k = 2 over candidates [0, 1, 2]. Run 1: the truth (1) scores 0.8 under the best but followed a
    match of 5 tokens (log 4 = 1.39), so a weight above 0.58 fixes both its drafts. Run 2: the truth (0) leads by
    2.0 while a wrong candidate followed that match, so a weight of 1.44 or more breaks both of its drafts."""
    cand = torch.tensor([[0, 1, 2]] * 4)
    scores = torch.tensor([[1.0, 0.2, 0.0], [1.0, 0.2, 0.0], [2.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    lengths = torch.tensor([[0, 5, 0], [0, 5, 0], [0, 5, 0], [0, 5, 0]])
    return [{"cand": cand, "scores": scores, "lengths": lengths, "truth": torch.tensor([1, 1, 0, 0]),
             "slot": torch.tensor([0, 1, 0, 1])}]


def test_the_fit_finds_the_weight_that_decoding_counts_best():
    rows = rows_with_a_window()
    assert expected_drafts(rows, torch.zeros(3), 2) == [0.5, 0.5]  # run 2 right, run 1 wrong
    assert expected_drafts(rows, torch.ones(3), 2) == [1.0, 1.0]
    assert expected_drafts(rows, torch.full((3,), 3.0), 2) == [0.5, 0.5]
    weights, record = fit(3, {"suite": rows}, 2)
    assert 0.58 < weights[0] < 1.44 and 0.58 < weights[1] < 1.44
    assert weights[2] == weights[1]  # positions after k share the k-th weight
    assert record[-1]["expected_drafts_summed_over_suites"] == 2.0 and len(record) == 2


def test_the_fit_refuses_an_adapter_without_a_head_and_its_own_folder(tmp_path, capsys):
    assert main([str(tmp_path), "--outputs-from", "x.json", "--out", str(tmp_path / "out")]) != 0
    assert "sampler head" in capsys.readouterr().err
    (tmp_path / "sampler_head.json").write_text("{}")
    assert main([str(tmp_path), "--outputs-from", "x.json", "--out", str(tmp_path)]) != 0
    assert "new folder" in capsys.readouterr().err
    assert main([str(tmp_path), "--traces", "--out", str(tmp_path / "out")]) != 0  # and no trace of its own
    assert "needs outputs" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an acceptance trace"):
        trace_outputs(tmp_path / "bad.json")


@pytest.mark.parametrize("length", [1, 2])
def test_matches_under_three_tokens_leave_the_head_as_it_was(length):
    rows = rows_with_a_window()
    rows[0]["lengths"] = rows[0]["lengths"].clamp(max=length)  # what the text's pairs and triples count already
    assert expected_drafts(rows, torch.full((3,), 4.0), 2) == [0.5, 0.5]


def test_the_fits_rows_count_as_the_drafts_benchmark_does():
    """rows_along + expected_drafts, at the head's own match weights, give the drafts benchmark's count
    (along_head's drafts against the truth, cumulative_acceptance) on the same outputs."""
    from test_head import tiny_sat_model

    from sdsat.bench.drafts import along_head, cumulative_acceptance

    sat_model = tiny_sat_model(head=True, combiner=8)
    gen = torch.Generator().manual_seed(5)
    runs = [([2, 5, 3], torch.randint(0, 8, (40,), generator=gen).tolist()) for _ in range(3)]
    runs[1][1][20:36] = runs[1][1][2:18]  # a long run for the term to follow
    misses = []
    for prompt, output in runs:
        _, student, truth = along_head(sat_model, prompt, output, 3)
        misses += student.argmax(-1).ne(truth).long().tolist()
    assert expected_drafts(rows_along(sat_model, runs, 3), sat_model.sampler.match_weight.detach(), 3) == \
        cumulative_acceptance(misses, 3)[0]
