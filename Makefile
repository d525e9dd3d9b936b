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

.PHONY: book test lab venv lint unit nbval execute student student-check bench clean

venv:
	@$(PYTHON) tools/setup_env.py

book: venv
	$(BIN)/python tools/execute.py --all --out build

test: venv
	$(BIN)/ruff check labutils tests benchmarks tools
	$(BIN)/python -m pytest tests --nbval-lax --sanitize-with notebooks/nbval_sanitize.cfg notebooks

lab: venv
	$(BIN)/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

# --- for authors --------------------------------------------------------------------------------
lint: venv
	$(BIN)/ruff check labutils tests benchmarks tools

unit: venv
	$(BIN)/python -m pytest tests

nbval: venv
	$(BIN)/python -m pytest --nbval-lax --sanitize-with notebooks/nbval_sanitize.cfg notebooks

execute: venv  ## refresh the committed outputs: make execute [NB=notebooks/01_fastmoe_core.ipynb]
	$(BIN)/python tools/execute.py --inplace $(NB)

student: venv  ## student copies with solutions stripped, under build/student/
	$(BIN)/python tools/student.py

student-check: venv  ## execute every student copy: runs up to the exercises, checkers fail on blanks
	$(BIN)/python tools/student.py --check

bench: venv
	$(BIN)/python benchmarks/launch.py

clean:
	rm -rf build .pytest_cache
