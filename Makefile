PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train.py --strategy pp-1f1b --stages 2 --dp 4 --zero 1 --microbatches 4 --steps 6

test: $(STAMP)
	$(BIN)/python -m pytest -q -x -n 2 --dist worksteal tests

clean:
	rm -rf $(VENV) *.egg-info
