"""The self-distillation corpus builder (sdsat/train/corpus.py) on a tiny random model with the real tokenizer."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama
from sdsat.train import corpus
from sdsat.train.data import HumanEvalFilter

SOURCE = '''"""A module of helpers, for the test."""

import math


def circle_area(radius):
    """Return the area of a circle with this radius, in square units of the radius."""
    return math.pi * radius ** 2


def has_close_elements(numbers, threshold):
    """Check if in given list of numbers, are any two numbers closer to each other than given threshold."""
    return False


class Shape:
    """A shape on the plane, with an area and a perimeter."""

    def perimeter(self):
        """The length of the shape's outline, as a float."""
        raise NotImplementedError
'''

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(real_tokenizer):
    model = make_tiny_llama(vocab_size=len(real_tokenizer), hidden_size=32)
    model.generation_config.eos_token_id = real_tokenizer.eos_token_id
    return model


@pytest.fixture
def recipe(tmp_path) -> corpus.CorpusRecipe:
    root = tmp_path / "code"
    root.mkdir()
    (root / "helpers.py").write_text(SOURCE)
    return corpus.CorpusRecipe(out=str(tmp_path / "corpus"), roots=[str(root)], shard_prompts=6, batch_size=3,
                               max_new_tokens=5)


def test_prompts_come_from_the_files_and_keep_humaneval_and_held_out_prompts_out(recipe):
    from sdsat.ui.examples import CHAT_EXAMPLES

    held_out = {CHAT_EXAMPLES[0][0]}
    rows = corpus.build_prompts(recipe, HumanEvalFilter(), held_out)
    texts = [row["text"] for row in rows]
    code = [row["text"] for row in rows if not row["chat"]]
    assert any(t.startswith("def circle_area(radius):") for t in code)  # a signature with its docstring
    assert any(t.startswith("class Shape:") for t in code) and any(t.startswith('"""A module') for t in code)
    assert any("circle_area(radius)" in row["text"] for row in rows if row["chat"])  # a docstring made a request
    assert not any("has_close_elements" in t for t in texts)  # a HumanEval entry point, in code and in chat
    assert CHAT_EXAMPLES[0][0] not in texts
    assert len(texts) == len(set(texts))


def test_a_resumed_build_writes_the_same_shards_as_an_uninterrupted_one(recipe, tiny, real_tokenizer, tmp_path):
    """Greedy and sampled batches alike: a build stopped after one shard and run again gives the files of one
    run through (the shards' contents; each also records its own wall time)."""
    whole = corpus.CorpusRecipe(**{**vars(recipe), "out": str(tmp_path / "whole")})
    corpus.build(whole, shards=2, model=tiny, tokenizer=real_tokenizer, progress=False)
    corpus.build(recipe, shards=1, model=tiny, tokenizer=real_tokenizer, progress=False)
    summary = corpus.build(recipe, shards=2, model=tiny, tokenizer=real_tokenizer, progress=False)
    assert summary["shards"] == 2 and summary["generated_tokens"] > 0
    for index in range(2):
        a, b = (_shard(corpus.shard_path(tmp_path / name, index)) for name in ("whole", "corpus"))
        assert a == b
    modes = {seq["mode"] for index in range(2) for seq in _shard(corpus.shard_path(tmp_path / "whole", index))}
    assert modes == {name for name, _, _ in corpus.MODES}  # greedy and both temperatures
    with pytest.raises(ValueError, match="another recipe"):
        corpus.build(corpus.CorpusRecipe(**{**vars(recipe), "max_new_tokens": 7}), shards=1, model=tiny,
                     tokenizer=real_tokenizer, progress=False)


def test_a_completion_drawn_in_a_batch_equals_the_same_completion_alone(tiny, real_tokenizer):
    prompts = [real_tokenizer(text).input_ids for text in ("def f(x):", "import os\nimport sys\n\nclass A:", "x =")]
    eos = {real_tokenizer.eos_token_id}
    batched = corpus.generate_batch(tiny, real_tokenizer, prompts, corpus.MODES[0], 8, eos, seed=0)
    alone = [corpus.generate_batch(tiny, real_tokenizer, [p], corpus.MODES[0], 8, eos, seed=0)[0] for p in prompts]
    assert batched == alone and all(len(c) == 8 for c in batched)


def test_completions_that_overlap_humaneval_are_dropped(recipe, tiny, real_tokenizer):
    rows = [{"text": "def add(a, b):", "chat": False}, {"text": "Say hello.", "chat": True}]
    eos = {real_tokenizer.eos_token_id}
    kept = corpus.build_shard(tiny, real_tokenizer, recipe, 0, rows, lambda text: False, eos)["sequences"]
    dropped = corpus.build_shard(tiny, real_tokenizer, recipe, 0, rows, lambda text: True, eos)["sequences"]
    assert len(kept) == 2 and dropped == []
    assert all(seq["ids"][:seq["prompt_tokens"]] != seq["ids"] for seq in kept)  # prompt plus its completion


def _shard(path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["sequences"]


def test_the_trainer_reads_the_built_corpus(recipe, tiny, real_tokenizer, tmp_path):
    from sdsat.train.trainer import TrainConfig, build_corpus

    corpus.build(recipe, shards=1, model=tiny, tokenizer=real_tokenizer, progress=False)
    config = TrainConfig(out=str(tmp_path / "run"), corpus=recipe.out, code_files=0)
    sources = build_corpus(config, tiny, real_tokenizer).sources
    shard = _shard(corpus.shard_path(tmp_path / "corpus", 0))
    assert sources["code_completions"] == [s["ids"] for s in shard if not s["chat"]]
    assert sources["chat_completions"] == [s["ids"] for s in shard if s["chat"]]
    with pytest.raises(ValueError, match="no shards yet"):
        build_corpus(TrainConfig(out=str(tmp_path / "run"), corpus=str(tmp_path / "empty"), code_files=0), tiny,
                     real_tokenizer)


def test_a_growing_corpus_never_holds_out_what_was_trained_on():
    from sdsat.train.data import Corpus

    first = [[i, i + 1, i + 2] for i in range(20)]
    grown = first + [[i, i * 3] for i in range(100, 140)]
    train_1, test_1 = Corpus({"code_completions": first}).split_stable(4)
    train_2, test_2 = Corpus({"code_completions": grown}).split_stable(4)
    assert len(test_1.sources["code_completions"]) == len(test_2.sources["code_completions"]) == 4
    assert not [s for s in test_2.sources["code_completions"] if s in train_1.sources["code_completions"]]
    assert sorted(train_2.sources["code_completions"] + test_2.sources["code_completions"]) == sorted(grown)


def test_a_build_can_take_another_builds_prompts_with_its_own_batches(recipe, tiny, real_tokenizer, tmp_path):
    """A GPU build reads the CPU build's prompt list (not the GPU machine's files), in bigger batches."""
    corpus.prepare(recipe)
    prompts = tmp_path / "corpus" / corpus.PROMPTS_FILE
    other = corpus.CorpusRecipe(out=str(tmp_path / "gpu"), prompts_from=str(prompts), max_prompts=4,
                                roots=[str(tmp_path / "nowhere")], shard_prompts=4, batch_size=4, max_new_tokens=5)
    corpus.build(other, shards=1, model=tiny, tokenizer=real_tokenizer, progress=False)
    with gzip.open(prompts, "rt") as f:
        first = [json.loads(line) for line in f][:4]
    with gzip.open(tmp_path / "gpu" / corpus.PROMPTS_FILE, "rt") as f:
        assert [json.loads(line) for line in f] == first
    assert len(_shard(corpus.shard_path(tmp_path / "gpu", 0))) == 4
    key = other.key()
    prompts.write_bytes(gzip.compress(b'{"text": "x = 1", "chat": false}\n'))
    assert other.key() != key  # the prompt file counts by its contents
    # Builds begun before these settings existed (in bfloat16, then the default) resume: their key is the one
    # they stored.
    old = dict(dtype="bfloat16")
    assert corpus.CorpusRecipe(out="a", **old).key() == corpus.CorpusRecipe(out="b", max_prompts=0, **old).key() == \
        "795b86f603290788"


def test_a_build_can_keep_to_greedy_text(recipe, tiny, real_tokenizer, tmp_path, capsys):
    """--modes greedy: every batch greedy (the default takes the decodings in turn); its own key, while the
    default key stays the one earlier builds stored; an unknown mode is one line naming the allowed ones."""
    greedy = corpus.CorpusRecipe(**{**vars(recipe), "out": str(tmp_path / "greedy"), "modes": ["greedy"]})
    corpus.build(greedy, shards=1, model=tiny, tokenizer=real_tokenizer, progress=False)
    corpus.build(recipe, shards=1, model=tiny, tokenizer=real_tokenizer, progress=False)
    assert {s["mode"] for s in _shard(corpus.shard_path(tmp_path / "greedy", 0))} == {"greedy"}
    assert len({s["mode"] for s in _shard(corpus.shard_path(tmp_path / "corpus", 0))}) > 1
    assert greedy.key() != recipe.key()
    for every in ([], ["t1.0", "greedy", "t0.7", "greedy"]):  # all of them, however named, is the default
        assert corpus.CorpusRecipe(modes=every, dtype="bfloat16").key() == "795b86f603290788"
    capsys.readouterr()
    assert corpus.main(["--out", str(tmp_path / "bad"), "--modes", "t2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "modes must be names among greedy, t0.7, t1.0; got ['t2']" in err, err
    assert not (tmp_path / "bad").exists()


def test_an_auto_precision_build_resumes_in_the_precision_it_was_begun_in(recipe, tiny, real_tokenizer, tmp_path):
    """--dtype auto (the default) is resolved once per folder: a build begun in bfloat16 resumes in it (the key
    its manifest stored), and a new folder takes the given model's precision."""
    begun = corpus.CorpusRecipe(**{**vars(recipe), "dtype": "bfloat16"})
    corpus.build(begun, shards=1, model=tiny, tokenizer=real_tokenizer, progress=False)
    assert recipe.dtype == "auto"
    corpus.build(recipe, shards=2, model=tiny, tokenizer=real_tokenizer, progress=False)
    assert corpus.shard_path(Path(recipe.out), 1).is_file()
    assert corpus.stored_dtype(Path(recipe.out)) == "bfloat16"
    fresh = corpus.CorpusRecipe(**{**vars(recipe), "out": str(tmp_path / "fresh")})
    corpus.build(fresh, shards=1, model=tiny, tokenizer=real_tokenizer, progress=False)
    assert corpus.stored_dtype(tmp_path / "fresh") == "float32"


def test_the_batched_precision_is_timed_on_a_copy_and_the_model_is_left_as_it_was(tiny):
    from sdsat.train.precision import fastest_batched_dtype

    chosen, seconds = fastest_batched_dtype(tiny, batch=2, length=8, repeats=1)
    assert set(seconds) == {"float32", "bfloat16"} and all(s > 0 for s in seconds.values())
    assert chosen == min(seconds, key=seconds.get)
    assert next(tiny.parameters()).dtype == torch.float32
