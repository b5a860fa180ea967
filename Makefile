# Two commands on a fresh machine: `make demo` and `make test`. Each builds the
# virtual environment first (torch installed before anything can pull a CUDA build).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
DEFAULT_EXTRAS := hooks,hf,trl,lightning,plot,ray,test
EXTRAS ?= $(DEFAULT_EXTRAS)
# With every extra the suite uses installed, a test skipped for a missing package fails the run (tests/needs.py).
REQUIRE_EXTRAS := $(if $(filter $(DEFAULT_EXTRAS),$(EXTRAS)),1,0)
DEMO_VENV ?= .venv-demo
BIN := $(VENV)/bin
STAMP := $(VENV)/.tokaudit-installed
DEMO_STAMP := $(DEMO_VENV)/.tokaudit-installed
# pip installs without compiling bytecode (all of torch and the trainers, most of it never imported: over a minute
# of a fresh set-up); what the commands below import is compiled once, on first import, and kept.
unexport PYTHONDONTWRITEBYTECODE
AUDITOR_SOURCES := $(wildcard auditor/*.py auditor/*/*.py auditor/*.json)

.PHONY: setup demo test test-fast lint typecheck wheel-smoke bench sample-logs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-compile -e ".[$(EXTRAS)]" --config-settings editable_mode=strict
	touch $(STAMP)

# The demo installs only what the audit needs (no torch, no trainers) in its own venv.
$(DEMO_STAMP): pyproject.toml Makefile $(AUDITOR_SOURCES)
	test -x $(DEMO_VENV)/bin/python || $(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-compile .
	touch $(DEMO_STAMP)

# Sample logs hold deliberate mistakes: exit 1 (findings) is the expected
# outcome; exit 2 (unreadable input) still fails the target.
demo: $(DEMO_STAMP)
	@rc=0; $(DEMO_VENV)/bin/tokaudit check sample_logs/ || rc=$$?; \
	if [ $$rc -gt 1 ]; then exit $$rc; fi

# Two xdist workers: the tests under tests/distributed/ run one after the other on one of them (tests/conftest.py).
test: setup lint typecheck wheel-smoke
	TOKAUDIT_REQUIRE_EXTRAS=$(REQUIRE_EXTRAS) $(BIN)/python -m pytest -q -n 2

test-fast: setup
	TOKAUDIT_REQUIRE_EXTRAS=$(REQUIRE_EXTRAS) $(BIN)/python -m pytest -q -n 2 -m "not distributed and not integration and not slow" --ignore=tests/distributed

lint: setup
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m ruff check .

typecheck: setup
	$(BIN)/python -m mypy
	$(BIN)/python -m mypy bench

# The editable install imports subpackages missing from `packages`; the wheel
# does not. Build it once and import everything from it. Built with the venv's own
# setuptools (the test extra's); `make demo` builds in an isolated environment.
wheel-smoke: setup
	rm -rf build/wheel build/wheel-unpacked
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w build/wheel .
	$(BIN)/python -m zipfile -e build/wheel/tokaudit-*.whl build/wheel-unpacked
	cd build && PYTHONPATH=$(CURDIR)/build/wheel-unpacked $(abspath $(BIN))/python -c \
	  "import tokaudit, tokaudit._checks.run, tokaudit._engine.database, tokaudit._normalization.decisions, tokaudit.cli, tokaudit.hooks, tokaudit._render, tokaudit._render.console; \
	   assert tokaudit.__file__.startswith('$(CURDIR)/build/wheel-unpacked'), tokaudit.__file__; \
	   print('wheel ok:', tokaudit.__version__)"
	cd build && PYTHONPATH=$(CURDIR)/build/wheel-unpacked $(abspath $(BIN))/python -m tokaudit --version

bench: setup
	$(BIN)/python bench/run.py

sample-logs: setup
	$(BIN)/python scripts/record_sample_logs.py sample_logs

clean:
	rm -rf $(VENV) $(DEMO_VENV) build *.egg-info .pytest_cache .mypy_cache
