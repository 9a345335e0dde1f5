# Two commands for a new machine:  make demo   and   make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU wheel of this exact version lies on local disk on our machines; an unpinned
# torch would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: demo test test-system test-times coverage lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-demo: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[examples,progress]'
	touch $@

$(VENV)/.installed-dev: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed-demo

demo: $(VENV)/.installed-demo
	rm -rf runs/demo
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/ringrun -np 2 --oversubscribe python examples/mnist_cnn.py --checkpoint-dir runs/demo

# Two tiers (docs/testing.md): the fast one for every change, the system one (container,
# Slurm, network-namespace hosts, shaped links, mpirun, fault hunts; root) before landing.
# Two pytest workers (pytest-xdist); --dist loadfile keeps a file's tests on one worker,
# so a module's shared world starts once. Beside a busy loop on a 2-core machine the fast
# tier took 310-384 s this way against 504 s in one process (docs/testing.md).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-dev
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -m "not system" -n $(TEST_WORKERS) --dist loadfile tests

test-system: $(VENV)/.installed-dev
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -m system tests

# Where the fast tier's time goes, beside a busy loop; rewrites the table in docs/testing.md.
test-times: $(VENV)/.installed-dev
	$(BIN)/python tests/times.py --tier fast --hog --write

# Line coverage of src/ringtrain per tier and both together (every process the tests start).
coverage: $(VENV)/.installed-dev
	$(BIN)/python tests/cover.py --tiers fast,system

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy src/ringtrain
