# Two commands a newcomer needs: `make demo` and `make test`. Everything else
# is here for developers. Every target creates .venv first if it is missing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

BENCH_ARGS ?=
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: all venv demo demo-hosts bench-hosts demo-loopback typecheck test test-quick soak protos bench bench-guard doctor gpu-check clean

all: test

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,mpi,daemon]'
	touch $(STAMP)

venv: $(STAMP)

# DEMO_ARGS='--timeline timeline' also writes each run's timeline (README, "Timeline").
DEMO_ARGS ?=

demo: $(STAMP)
	$(BIN)/python examples/ps_training.py $(DEMO_ARGS)

# The demo across three "hosts" (network namespaces; needs root): tests/netns.py.
demo-hosts: $(STAMP)
	$(BIN)/python tests/netns.py demo

# bench-steps with its two ranks on two such hosts (MPI and gloo over eth0);
# STEPS_ARGS as for make bench, e.g. STEPS_ARGS='--steps 5 --models resnet50'.
bench-hosts: $(STAMP)
	$(BIN)/python tests/netns.py bench-steps $(STEPS_ARGS)

demo-loopback: $(STAMP)
	$(BIN)/python examples/loopback_demo.py

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,mpi,daemon,bench]'
	touch $(BENCH_STAMP)

STEPS_ARGS ?=
DAEMON_ARGS ?=
SCALE_ARGS ?=

bench: $(BENCH_STAMP)
	$(BIN)/python -m rendezvous bench $(BENCH_ARGS)
	$(BIN)/python -m rendezvous bench-steps $(STEPS_ARGS)
	$(BIN)/python -m rendezvous bench-daemon $(DAEMON_ARGS)
	$(BIN)/python -m rendezvous bench-scale $(SCALE_ARGS)

# The regression guard (CI runs it after make test): the quick matrix, every
# way to move a tensor against its raw transport in one run, judged against
# the floors in rendezvous/bench/floors.json; prints the matrix, fails below a floor.
bench-guard: $(BENCH_STAMP)
	$(BIN)/python -m rendezvous bench --guard rendezvous/bench/floors.json --out bench-results/guard

# The checks only a real GPU can make (rendezvous/bench/gpu_check.py): the
# content checks of tests/test_gpu_cupy.py, then the staged bandwidth against
# D2H and raw MPI. Where nvidia-smi runs, the gpu extra (cupy) is installed
# first; without cupy or a CUDA device it says so, skips, and exits 0.
GPU_CHECK_ARGS ?=

gpu-check: $(BENCH_STAMP)
	if nvidia-smi >/dev/null 2>&1; then $(BIN)/python -m pip install --quiet -e '.[gpu]'; fi
	$(BIN)/python -m rendezvous.bench.gpu_check $(GPU_CHECK_ARGS)

# The type check: the whole package, strict on the public API (pyproject.toml,
# [tool.mypy]); a second of work once .mypy_cache holds the last run.
typecheck: $(STAMP)
	$(BIN)/python -m mypy

test: typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The everyday run: the type check, then everything but the tests marked slow
# (multi-second mpiexec jobs, process faults) and huge (tensors over 2 GiB).
test-quick: typecheck
	$(BIN)/python -m pytest -m "not slow and not huge" $(PYTEST_ARGS)

SOAK_OPS ?= 100000
RACE_TENSORS ?= 20000

# The long reliability run (RELIABILITY.md): SOAK_OPS transfers through two
# daemons with deadlines racing replies and hostile requests mixed in, then
# the exactly-once races of tests/test_no_loss.py with RACE_TENSORS tensors.
soak: $(STAMP)
	RENDEZVOUS_SOAK_OPS=$(SOAK_OPS) $(BIN)/python -m pytest -q -s -p no:randomly tests/test_soak.py
	RENDEZVOUS_RACE_TENSORS=$(RACE_TENSORS) $(BIN)/python -m pytest -q -p no:randomly tests/test_no_loss.py

protos: $(STAMP)
	$(BIN)/python tools/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache
