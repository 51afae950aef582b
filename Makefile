# Two commands a fresh clone needs: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
STAMP := .install-stamp

.PHONY: install demo test lint bench

$(STAMP): pyproject.toml constraints.txt
	@echo "installing tailorstore with pinned torch 2.13.0 (CPU), DeepSpeed and transformers into $$($(PYTHON) -c 'import sys; print(sys.prefix)')"
	@echo "(2-3 minutes the first time; use a virtualenv if this Python has a GPU torch you want to keep)"
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0 -e ".[dev]"
	$(PYTHON) -m compileall -q tailorstore cli  # an editable install writes no bytecode; start-up pays without it
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m examples.demo

test: $(STAMP)
	$(PYTHON) -m pytest -q

lint: $(STAMP)
	$(PYTHON) -m ruff check .

bench: $(STAMP)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,bench]"
	$(PYTHON) -m benchmarks --sizes small,medium,large --repeats 3
