# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv when absent and installs vltrain with torch pinned to 2.13.0
# (a CPU build where that is what pip finds; on GPU machines the same version's CUDA build).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
OPEN_CLIP_VERSION := 3.3.0
STAMP := $(VENV)/.installed
# open_clip_torch: the reference OpenCLIP tokenizer of tests/data/tools/test_openclip_tokenizer.py,
# read there by file path. Installed without its dependencies: the package imports torchvision,
# which does not load beside this CPU torch.

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps open_clip_torch==$(OPEN_CLIP_VERSION)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vltrain demo

# -n auto: one pytest-xdist worker per core; --dist loadfile keeps a file's tests (and the runs its
# module fixtures share) on one worker; --no-loadscope-reorder hands out the files in the order
# tests/conftest.py gives them, longest first. A single test still runs with plain `pytest`.
# Bytecode is cached (in the gitignored __pycache__ folders) even where the environment sets
# PYTHONDONTWRITEBYTECODE: the suite starts about eighty fresh interpreters (torchrun's workers, the
# launch tests), and each would compile vltrain's sources again (0.6 CPU-s), as each pytest worker
# would its test modules' rewritten asserts.
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

test-fast: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder -m 'not slow'

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
