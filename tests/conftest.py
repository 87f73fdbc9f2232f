"""Shared fixtures: tiny random Llama models built from a config, and the real default model."""

from __future__ import annotations

import os
from html.parser import HTMLParser

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The SAT rows' compiled update (sdsat/sat_kernel.py) is built in the background and taken up when ready, which
# would change SAT logits by rounding in the middle of a test; tests/test_sat_kernel.py turns it on.
os.environ.setdefault("SDSAT_SAT_KERNEL", "0")
# The compiled attention form (sdsat/csrc/attend.cpp) is offered where the kernels are built; a tuning that builds
# them takes half a minute per worker, so tests/test_compiled_attention.py alone turns it on.
os.environ.setdefault("SDSAT_ATTENTION_KERNEL", "0")
# The compiled row-invariant product (sdsat/csrc/linear.cpp) likewise: a tuning would build the kernels, and which
# product a test ran would hang on whether another worker had built them; tests that need it turn it on.
os.environ.setdefault("SDSAT_LINEAR_KERNEL", "0")
# The sampler head's compiled scores (sdsat/csrc/head_score.cpp) likewise: once a worker has built the kernels, a head
# test would otherwise take them or not by the order tests ran; tests that need them turn them on.
os.environ.setdefault("SDSAT_HEAD_KERNEL", "0")

# pytest-xdist's workers share the cores: each worker, and every process it starts, gets its share of them.
# Two pools of OpenMP workers that spin-wait on the same cores slow each other several-fold (a test that
# takes 43 s alone took 187 s beside another worker's). Set before torch is imported; a test that needs
# more threads sets OMP_NUM_THREADS for its own subprocess.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Tests slow only by their size run smaller in `make test-slow`, in full with SDSAT_FULL_TESTS=1 (the API fuzz and
# the race soak, test_public_api.py).
FULL_TESTS = os.environ.get("SDSAT_FULL_TESTS", "") not in ("", "0")


def make_tiny_llama(vocab_size: int = 64, hidden_size: int = 32, layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A random Llama small enough for hundreds of decodes per second on a CPU."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=1, bos_token_id=0, pad_token_id=0,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


# The modules that take longest, longest first: `make test` runs the modules on two workers (pytest-xdist,
# --dist loadfile, in this order with --no-loadscope-reorder), and starting the long ones first keeps one worker
# from running a long module alone at the end.
LONG_MODULES = ("test_bench.py", "test_page.py", "test_first_minutes.py", "test_sampling.py", "test_cli.py",
                "test_head.py", "test_tuning.py", "test_robustness.py", "test_compute.py", "test_space.py",
                "test_public_api.py", "test_ctrl_c.py", "test_drafts.py", "test_app.py", "test_train.py",
                "test_default_model.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_MODULES)))  # stable: order within a module kept


def pytest_configure(config):
    config.addinivalue_line("markers", "soak: minutes-long server tests (the API fuzz and the race soak); "
                            "`make test-slow` runs them (CI too), `make test` leaves them out")
    config.addinivalue_line("markers", "deploy: the app as deployed, a Space's fresh environment and ZeroGPU; "
                            "`make test-slow` runs them (CI too), `make test` leaves them out")


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


def tree_seen(parents: list[int], cached: int) -> torch.Tensor:
    """(nodes, cached + nodes) boolean: the keys each node of a draft tree sees (the cache, its ancestors, itself);
    parents[i] is node i's parent, -1 for the root."""
    seen = torch.zeros(len(parents), cached + len(parents), dtype=torch.bool)
    seen[:, :cached] = True
    for node in range(len(parents)):
        ancestor = node
        while ancestor >= 0:
            seen[node, cached + ancestor], ancestor = True, parents[ancestor]
    return seen


@pytest.fixture
def native_kernels(monkeypatch):
    """The compiled kernels (sdsat/native.py) with all four switched on; skipped where they cannot be built."""
    from sdsat import native

    monkeypatch.setenv("SDSAT_SAT_KERNEL", "1")
    monkeypatch.setenv("SDSAT_HEAD_KERNEL", "1")
    monkeypatch.setenv("SDSAT_ATTENTION_KERNEL", "1")
    monkeypatch.setenv("SDSAT_LINEAR_KERNEL", "1")
    module = native.build()
    if module is None:
        pytest.skip(f"the compiled kernels cannot be built on this machine ({native._failed})")
    return module


@pytest.fixture(scope="session")
def default_engine():
    """The embedded default model with its shipped SATs, loaded once per test session."""
    from sdsat.engine import Engine

    return Engine.load()


@pytest.fixture(scope="session")
def tuning_file(tmp_path_factory):
    """Where tuned_engine keeps its measurement: the first module to tune measures, the others read it back
    (as `Engine.tune` reads ~/.cache/sdsat/tuning.json at a later start)."""
    return tmp_path_factory.mktemp("tuning") / "tuning.json"


def quick_curve(sat_model, **kwargs):
    """`measure_curve`, short: one round of a few widths behind 32 cached tokens."""
    from sdsat.costs import measure_curve

    return measure_curve(sat_model, **(dict(widths=(1, 2, 4, 8, 16), context=32, repeats=1) | kwargs))


def measure_quickly(patch: pytest.MonkeyPatch) -> None:
    """The tuning's measurements, short: `quick_curve`, the row check on two block widths, and each form's
    one-token pass timed once. No assertion of a test depends on timings; at full length they take minutes at
    one thread. (The kernel plan is read from the cache where one is kept; tests that start from an empty cache
    shorten it too.)"""
    from sdsat import tuning
    from sdsat.costs import check_rows

    patch.setattr(tuning, "measure_curve", quick_curve)
    patch.setattr(tuning, "check_rows", lambda sat_model, **kwargs: check_rows(sat_model, **(dict(widths=(2, 5))
                                                                                           | kwargs)))
    patch.setattr(tuning, "REVISIT_ROUNDS", 0)


@pytest.fixture(scope="module")
def tuned_engine(default_engine, tuning_file):
    """The default engine as `Engine.tune` leaves it, measured quickly (its loaded precision only,
    `measure_quickly`) once per session; afterwards as loaded, for the other tests."""
    from sdsat import tuning

    patch = pytest.MonkeyPatch()
    measure_quickly(patch)
    try:
        default_engine.tuning = tuning.tune(default_engine.sat_model, default_engine.name, fixed_dtype=True,
                                            cache_file=tuning_file)
        yield default_engine
    finally:
        patch.undo()
        tuning.set_precision(default_engine.sat_model, "float32", form=tuning.ROUTED)
        default_engine.tuning = None


@pytest.fixture(scope="session")
def real_tokenizer():
    """The default model's tokenizer; tiny models use its first ids."""
    from transformers import AutoTokenizer

    from sdsat.models import default_model_folder

    return AutoTokenizer.from_pretrained(default_model_folder())


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One torch thread for the whole session: on a shared 2-core machine, thread hand-offs make two
    threads several times slower (tiny models ~50x, the default model's tuning ~10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The only tags the page's own HTML uses: anything else in a fragment came from escaped-badly text.
OUR_TAGS = {"div", "span", "sub", "b", "table", "tr", "th", "td", "code", "ul", "li"}


class HtmlTags(HTMLParser):
    """Every tag name in a page fragment, and the text between tags."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)

    def handle_data(self, data):
        self.text.append(data)


def parse_html(fragment: str) -> HtmlTags:
    parser = HtmlTags()
    parser.feed(fragment)
    return parser
