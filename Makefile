# The two commands a new user needs: `make demo` and `make test`.
# Both create .venv on first use and reuse it afterwards; the install is re-run only when
# pyproject.toml or constraints.txt change (tracked by .venv/.installed).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The registry's connection sometimes drops in the middle of a large wheel (CI once lost torch's
# 156 MB triton wheel at 140 MB after pip's default 5 resumes): resume more often, and run the
# whole install up to three times before giving up. PIP_RESUME_RETRIES, not --resume-retries,
# because the venv's first pip (before it upgrades itself) does not know the option.
export PIP_RESUME_RETRIES ?= 30
export PIP_RETRIES ?= 10
ATTEMPTS := 1 2 3

.PHONY: demo test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	for attempt in $(ATTEMPTS); do \
	  $(BIN)/python -m pip install --quiet --upgrade pip && exit 0; sleep 10; \
	done; exit 1

# constraints.txt pins torch to the release Composer accepts (torch<2.7.1).
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	for attempt in $(ATTEMPTS); do \
	  $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[all,dev]' && exit 0; \
	  echo "pip install failed (attempt $$attempt of 3); retrying in 20 s" >&2; sleep 20; \
	done; exit 1
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/ruff check stalwart tests benchmarks examples
	$(BIN)/python -m pytest -q
