# stoker developer entry points. Each target does its own set-up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Temporaries: the demo's data and caches go to $TMPDIR/stoker-demo (stoker demo's default
# --workdir); the tests' to $(TEST_TMP): pytest's --basetemp (emptied when a run starts, so one
# run's files at most) and the default node cache of the tests that name none. `make clean`
# removes both, with the environment.
TMP := $(or $(TMPDIR),/tmp)
TEST_TMP ?= $(TMP)/stoker-tests-$(shell id -u)

.PHONY: venv demo demo-quick test lint format bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints-dev.txt src/stoker/decode/_jpegroi.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-dev.txt -e '.[dev]'
	touch $(STAMP)

demo: venv
	$(BIN)/stoker demo --json demo-out/demo.json --plot demo-out/demo.png

demo-quick: venv
	$(BIN)/stoker demo --quick --json demo-out/demo-quick.json --plot demo-out/demo-quick.png

# Two pytest workers (pytest-xdist), each taking a whole test file at a time: the files' module
# fixtures (Ray clusters, origins) stay in one process; each worker has its own node cache
# (tests/conftest.py).
test: venv
	bash scripts/system_deps.sh
	mkdir -p $(TEST_TMP)
	STOKER_CACHE_DIR=$(TEST_TMP)/cache $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 --basetemp=$(TEST_TMP)/pytest

# ruff (E, F, I, B, UP; D for src/), ruff format and mypy, configured in pyproject.toml.
lint: venv
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

# rewrite src/ and tests/ in the house format (ruff format, configured in pyproject.toml)
format: venv
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

# the environment, the demo's output and data, the tests' temporaries; not the benchmarks'
# environments (~/.cache/stoker-bench, made by `stoker bench peers` / `bench decode`) nor a node
# cache of your own (`stoker cache clear DIR` empties one)
clean:
	rm -rf $(VENV) demo-out .pytest_cache $(TMP)/stoker-demo $(TMP)/stoker-demo-tokens $(TEST_TMP)
