# The two commands of the quick start: `make train` and `make test`.
# Each creates the local virtual environment .venv on first use (or when pyproject.toml or
# constraints.txt changes), with the exact versions of constraints.txt.
# `make test-min` runs the suite in .venv-min on the lowest versions pyproject.toml declares
# (constraints-min.txt): its torch is a CUDA build from PyPI, several GB, so only that target pulls it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
VENV_MIN := .venv-min
STAMP_MIN := $(VENV_MIN)/.installed

.PHONY: train test test-all test-min bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test,hf]'
	touch $(STAMP)

$(STAMP_MIN): pyproject.toml constraints-min.txt
	test -x $(VENV_MIN)/bin/python || $(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/python -m pip install -q --upgrade pip
	$(VENV_MIN)/bin/python -m pip install -q -c constraints-min.txt -e '.[test]'
	touch $(STAMP_MIN)

train: $(STAMP)
	$(VENV)/bin/mirrored train $(ARGS)

# pytest exits 5 when it collects nothing; that is not a failure of the code under test.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m '' $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-min: $(STAMP_MIN)
	$(VENV_MIN)/bin/python -m pytest -q $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

clean:
	rm -rf $(VENV) $(VENV_MIN) build src/*.egg-info

# The documentation site (docs/) into build/docs; warnings are errors, as in CI.
.PHONY: docs
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/python -m sphinx -W --keep-going -q -b html docs build/docs
