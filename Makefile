# The two commands of the quick start: `make train` and `make test`.
# Each creates the local virtual environment .venv on first use (or when pyproject.toml changes).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: train test test-all bench clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/mirrored train $(ARGS)

# pytest exits 5 when it collects nothing; that is not a failure of the code under test.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m '' $(ARGS); rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

clean:
	rm -rf $(VENV) build src/*.egg-info

# The documentation site (docs/) into build/docs; warnings are errors, as in CI.
.PHONY: docs
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install -q -e '.[test,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/python -m sphinx -W --keep-going -q -b html docs build/docs
