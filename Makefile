# `make demo` and `make test` each create/refresh .venv, install dsv4 and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel of 2.13.0 (an unpinned torch pulls a CUDA build)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/dsv4 make-tiny --arch v41 --out .demo/v41-tiny --seed 0
	$(BIN)/dsv4 generate --model .demo/v41-tiny --max-tokens 16 "The capital of France is"

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .demo
