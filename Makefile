# The MoE Lab Book. Two commands do everything on a fresh Linux machine with Python >= 3.10 and pip:
#   make book   # set up .venv on first use, execute every chapter into build/ (HTML too), one line per chapter
#   make test   # set up .venv on first use, lint, unit tests, nbval over every notebook, browser test
# and `make lab` opens JupyterLab on notebooks/ with the environment's kernel.
# LAB_PRESET=full selects the book-scale run (default: tiny, what CI and the committed outputs use).

VENV   := .venv
BIN    := $(VENV)/bin
PYTHON ?= python3
NB     ?= notebooks/[0-9][0-9]_*.ipynb

export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export JUPYTER_PATH         := $(CURDIR)/$(VENV)/share/jupyter
export PYTHONHASHSEED       := 0

QUICK  := not dist and not kernel and not browser and not gpu

.PHONY: help book test lab venv lint quick unit nbval execute student student-check bench hooks clean mutate faults stats

help:  ## this list
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## /  make \1\t/' | expand -t 24

venv:  ## create .venv (first use only; every other target does it for you)
	@$(PYTHON) tools/setup_env.py

book: venv  ## execute every chapter into build/ (HTML too), one line per chapter
	$(BIN)/python tools/execute.py --all --out build

test: venv lint  ## lint, then unit tests + nbval over every notebook + browser test
	$(BIN)/python -m pytest tests --nbval-lax --sanitize-with notebooks/nbval_sanitize.cfg notebooks

lab: venv  ## JupyterLab on notebooks/ with the lab's kernel
	$(BIN)/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

# --- for authors --------------------------------------------------------------------------------
lint: venv  ## ruff, pyright (basic, public API) and notebook hygiene
	$(BIN)/ruff check labutils labbook tests benchmarks tools
	$(BIN)/basedpyright --level error
	$(BIN)/python tools/nbhygiene.py

quick: venv  ## unit tests without workers, kernels or a browser (under a minute)
	$(BIN)/python -m pytest tests -q -m "$(QUICK)"

unit: venv  ## every test in tests/ (no nbval)
	$(BIN)/python -m pytest tests

nbval: venv  ## every notebook under nbval
	$(BIN)/python -m pytest --nbval-lax --sanitize-with notebooks/nbval_sanitize.cfg notebooks

execute: venv  ## refresh the committed outputs: make execute [NB=notebooks/01_fastmoe_core.ipynb]
	$(BIN)/python tools/execute.py --inplace $(NB)

student: venv  ## student copies with solutions stripped, under build/student/
	$(BIN)/python tools/student.py

student-check: venv  ## execute every student copy: runs up to the exercises, checkers fail on blanks
	$(BIN)/python tools/student.py --check

stats: venv  ## each chapter's code lines, longest cell, strings share (issue 39's table); exit 1 on a missed target
	$(BIN)/python tools/chapter_stats.py

mutate: venv  ## mutation testing (mutmut): make mutate [MODULE=labutils/moe/capacity.py]; record in docs/mutation.json
	$(BIN)/python tools/mutate.py $(if $(MODULE),$(MODULE),--all)

faults: venv  ## inject every chapter's listed faults, one line each (tests/test_chapter_faults.py asserts them)
	$(BIN)/python -m labbook.faults --record docs/faults.json

bench: venv  ## the launcher benchmark (others: python benchmarks/<name>.py)
	$(BIN)/python benchmarks/launch.py

hooks: venv  ## install pre-commit (pinned) and register .pre-commit-config.yaml's local hooks
	$(BIN)/pip install -q pre-commit==4.7.0
	$(BIN)/pre-commit install

clean:  ## remove build/ and pytest caches
	rm -rf build .pytest_cache
