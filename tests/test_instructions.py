"""Varied chat instructions (sdsat/train/instructions.py) and a corpus build that takes them."""

from __future__ import annotations

import gzip
import random

import pytest

from sdsat.train import corpus, instructions
from sdsat.train.data import HumanEvalFilter

MAN_PAGE = '''.\\" a comment
.TH WC 1
.SH NAME
wc \\- print newline, word, and byte counts for each file
.SH SYNOPSIS
'''
POD_PAGE = '''.IX Title "LWP-REQUEST 1p"
.SH "NAME"
.IX Header "NAME"
\\fBlwp\\-request\\fR \\- Simple command line user agent
.SH "SYNOPSIS"
'''
STATUS = '''Package: xz-utils
Status: install ok installed
Version: 5.4.1
Description: XZ-format compression utilities
 XZ is the successor to the Lempel-Ziv/Markov-chain Algorithm.

Package: tiny
Description: x
'''


def test_manual_pages_and_packages_give_one_line_summaries(tmp_path):
    for name, text in (("wc.1.gz", MAN_PAGE), ("GET.1p.gz", POD_PAGE), ("broken.1.gz", "not gzip")):
        data = gzip.compress(text.encode()) if name != "broken.1.gz" else text.encode()
        (tmp_path / name).write_bytes(data)
    assert sorted(instructions.man_summaries(tmp_path)) == [
        ("lwp-request", "simple command line user agent"), ("wc", "print newline, word, and byte counts for each file")]
    (tmp_path / "status").write_text(STATUS)
    assert instructions.package_summaries(tmp_path / "status") == [("xz-utils", "XZ-format compression utilities")]
    assert instructions.package_summaries(tmp_path / "missing") == []
    assert instructions.man_summaries(tmp_path / "missing") == []


def test_varied_instructions_take_turns_among_their_sources_and_are_seeded(monkeypatch):
    monkeypatch.setattr(instructions, "man_summaries", lambda: [("wc", "count the lines of a file")])
    monkeypatch.setattr(instructions, "package_summaries", lambda: [("xz-utils", "XZ-format compression utilities")])
    first = instructions.varied_instructions(random.Random(1))
    assert first == instructions.varied_instructions(random.Random(1)) != instructions.varied_instructions(
        random.Random(2))
    assert len(first) > 2000
    sources = [{t.format(x) for t in templates for x in topics} for templates, topics in (
        (instructions._EXPLAIN, instructions._TOPICS), (instructions._WRITE, instructions._SITUATIONS),
        (instructions._CODE, instructions._ACTIONS))]
    head = first[:5]  # one from each source before any source gives a second
    assert [sum(x in source for x in head) for source in sources] == [1, 1, 1]
    assert sum("`wc`" in x for x in head) == 1 and sum("xz-utils" in x for x in head) == 1
    assert instructions.varied_instructions(random.Random(1), limit=7) == first[:7]


def test_a_varied_build_mixes_its_instructions_in_and_keeps_its_own_key(tmp_path, monkeypatch):
    """A build with varied instructions has them among its chat prompts, early (they take turns with the
    docstrings' requests); its key differs, while a templates build keeps the key earlier builds stored."""
    root = tmp_path / "code"
    root.mkdir()
    (root / "helpers.py").write_text('def area(r):\n    """Return the area of a circle of radius r."""\n'
                                     '    return 3.14159 * r * r\n')
    monkeypatch.setattr(instructions, "man_summaries", lambda: [])
    monkeypatch.setattr(instructions, "package_summaries", lambda: [])
    templates = corpus.CorpusRecipe(out=str(tmp_path / "t"), roots=[str(root)], chat_share=1.0)
    varied = corpus.CorpusRecipe(**{**vars(templates), "instructions": "varied"})
    assert varied.key() != templates.key()
    assert corpus.CorpusRecipe(modes=["greedy"], dtype="float32", seed=2).key() == "b16657ffa5c2bed3"  # stored
    made = set(instructions.varied_instructions(random.Random(0)))
    rows = corpus.build_prompts(varied, HumanEvalFilter(), set())
    assert len({row["text"] for row in rows}) == len(rows)  # the page's examples once each
    assert sum(row["text"] in made for row in rows[:20]) >= 5
    assert made <= {row["text"] for row in rows}
    assert len(made & {row["text"] for row in corpus.build_prompts(templates, HumanEvalFilter(), set())}) < 100
    bad = corpus.CorpusRecipe(**{**vars(templates), "instructions": "novels"})
    with pytest.raises(ValueError, match="instructions must be one of templates, varied, got 'novels'"):
        corpus.prepare(bad)
    assert not (tmp_path / "t").exists()  # refused before anything was written
