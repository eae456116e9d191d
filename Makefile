# Two commands a newcomer needs: `make demo` and `make test`. Everything else
# is here for developers. Every target creates .venv first if it is missing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: all venv demo test test-fast protos bench clean

all: test

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,mpi]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/loopback_demo.py

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
