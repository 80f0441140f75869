# The two commands a new user needs: `make demo` and `make test`.
# Both create .venv on first use and reuse it afterwards; the install is re-run only when
# pyproject.toml or constraints.txt change (tracked by .venv/.installed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# constraints.txt pins torch to the release Composer accepts (torch<2.7.1).
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[all,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/ruff check stalwart tests benchmarks examples
	$(BIN)/python -m pytest -q
