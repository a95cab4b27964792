# Two commands do all set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# The pinned stack differs per device: DEVICE=cuda|cpu. Left out, it is detected on the machine
# that runs make (CPU fbgemm where nvidia-smi sees no GPU): right for a developer's `make setup`,
# wrong for an image built on a GPU-less builder, which must pass DEVICE=cuda (docs/distributed.md).
ifeq ($(origin DEVICE),undefined)
DEVICE := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
DEVICE_WHY := detected: nvidia-smi $(if $(filter cuda,$(DEVICE)),lists a GPU,lists no GPU here); pass DEVICE=cuda|cpu to choose
else
DEVICE_WHY := DEVICE=$(DEVICE) given
endif
ifeq ($(filter cpu cuda,$(DEVICE)),)
$(error DEVICE must be cpu or cuda, got '$(DEVICE)')
endif
STAMP  := $(VENV)/.installed-$(DEVICE)
ARGS   ?=
# pytest-xdist workers: most tests wait for a subprocess to start on one core, so two pay off
# even on 2 cores; tests/conftest.py splits the cores' threads between them.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

.PHONY: setup train test lint test-portability test-mutation bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/$(DEVICE).txt
	@echo "rankmix: installing the $(DEVICE) stack ($(DEVICE_WHY))"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements/$(DEVICE).txt
	# torchrec declares the CUDA fbgemm-gpu; its real needs are in requirements/.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	# the CUDA wheels must agree with each other and with the driver; a mismatch leaves setup undone
	if [ "$(DEVICE)" = cuda ]; then $(BIN)/rankmix doctor; fi
	touch $@

train: setup
	$(BIN)/rankmix train $(ARGS)

# The bench scripts' end-to-end runs (pytest -m bench) are `make bench`'s: they time things,
# and they took a third of the suite's time.
test: setup
	$(PYTEST) tests -m "not bench" $(ARGS)

# ruff, as configured in pyproject.toml; `make test` runs the same check (tests/test_lint.py).
lint: setup
	$(BIN)/ruff check .

# Tests of trained quantities under other kernels (ATen's dispatch level) and one thread:
# other rounding, other summation order. `make test-portability PORTABILITY_ARGS=` runs them all.
# One pytest process, so that runs keep the machine's thread count (workers split the cores).
PORTABILITY_ARGS ?= -m trained
test-portability: setup
	ATEN_CPU_CAPABILITY=default $(PYTEST) -n 0 tests $(PORTABILITY_ARGS)
	ATEN_CPU_CAPABILITY=avx2 $(PYTEST) -n 0 tests $(PORTABILITY_ARGS)
	OMP_NUM_THREADS=1 $(PYTEST) -n 0 tests $(PORTABILITY_ARGS)

# Mutation testing (mutmut) of the pure-logic modules, each against its own fast tests:
# prints each module's kill rate and its surviving mutants (CONTRIBUTING.md, "Mutation testing").
# Not part of `make test`; its time is in docs/performance.md. `make test-mutation MUTATION_ARGS=ids` runs one module.
MUTATION_ARGS ?=
test-mutation: setup
	$(BIN)/python tests/mutation.py --workers $(TEST_WORKERS) $(MUTATION_ARGS)

# Every bench script end to end in its small preset (the tests marked bench), then the towers' bench.
bench: setup
	$(PYTEST) tests -m bench $(ARGS)
	$(BIN)/python bench/tower.py

clean:
	rm -rf $(VENV) runs .cache
