# DeepFreeze developer entry points. Both targets run the idempotent setup first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
MPIRUN := mpirun --oversubscribe $(if $(filter 0,$(shell id -u)),--allow-run-as-root,)
DEMO_OUT ?= $(CURDIR)/_work/demo
# ENGINE=veloc runs the demo on a VeloC install pointed to by DEEPFREEZE_VELOC_PREFIX
ENGINE ?= builtin
PYTEST_ARGS ?=
# pytest-xdist workers of test and test-all (TEST_WORKERS=0: one process, no xdist). --dist loadgroup
# keeps each xdist_group on one worker (tests/conftest.py: a module-scoped fixture's tests, VeloC's)
TEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadgroup)

.PHONY: setup demo test test-all bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	@rm -rf "$(DEMO_OUT)" && mkdir -p "$(DEMO_OUT)"
	DEEPFREEZE_ENGINE=$(ENGINE) $(MPIRUN) -np 2 $(PY) examples/demo.py train "$(DEMO_OUT)"
	DEEPFREEZE_ENGINE=$(ENGINE) $(PY) examples/demo.py restore "$(DEMO_OUT)"
	@if [ "$(ENGINE)" = veloc ]; then $(PY) -c "from deepfreeze.veloc_daemon import stop_backend as s; \
	  p = s(); print(f'demo: stopped veloc-backend {p}' if p else '')"; fi
	@mkdir -p "$(DEMO_OUT)/torch"
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/torch_demo.py train "$(DEMO_OUT)/torch"
	$(PY) examples/torch_demo.py restore "$(DEMO_OUT)/torch"

# Byte-compiled once before the suite: its ~1,100 Python processes then read deepfreeze's modules
# instead of compiling them each (0.1 CPU-s per process here), also where PYTHONDONTWRITEBYTECODE is set.
# A file that does not compile is left to pytest, which reports it where it is imported.
COMPILE := $(PY) -m compileall -q -j 0 deepfreeze tests experiments examples >/dev/null || true

test: setup
	@$(COMPILE)
	$(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-all: setup
	@$(COMPILE)
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

clean:
	rm -rf _work .pytest_cache
