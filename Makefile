# Two commands a fresh clone needs: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
# One stamp per interpreter: a new virtualenv installs afresh, whatever another one holds.
STAMP := .install-stamp-$(shell $(PYTHON) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])')
# The tests start `tailor` as a user does: from the bin folder of the Python it was installed into.
export PATH := $(shell $(PYTHON) -c 'import os, sys; print(os.path.dirname(os.path.abspath(sys.executable)))'):$(PATH)

.PHONY: install demo test lint bench browser

$(STAMP): pyproject.toml constraints.txt
	@echo "installing tailorstore with pinned torch 2.13.0 (CPU), DeepSpeed and transformers into $$($(PYTHON) -c 'import sys; print(sys.prefix)')"
	@echo "(2-3 minutes the first time; use a virtualenv if this Python has a GPU torch you want to keep)"
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0 -e ".[dev]"
	@# torchtitan's checkpoint manager, for its adapter's tests; without the packages its trainer needs
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps -c constraints.txt torchtitan
	$(PYTHON) -m compileall -q tailorstore cli  # an editable install writes no bytecode; start-up pays without it
	touch $(STAMP)

install: $(STAMP)

# The report page's browser tests (tests/system/test_report_page.py) drive the system's chromium through
# Playwright, which downloads no browser. Where it is missing and apt-get can install it (Debian,
# as root: CI's machine), this installs Debian's; elsewhere those tests skip, with one line saying
# what to install.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	      apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } || \
	      echo "apt-get could not install chromium: the report page's browser tests will skip"; \
	    else echo "no chromium, and no root apt-get to install it: the report page's browser tests will skip"; fi; }

demo: $(STAMP)
	$(PYTHON) -m examples.demo

# In tiers, cheapest first, so a broken build fails in seconds: lint, the fast tier (no training,
# under a minute), then the slow tier (real DeepSpeed, HF and S3 runs). Each test has a time limit,
# so a hang names its test instead of eating CI's 90 minutes. Both tiers run on two workers
# (pytest-xdist; the slow tier a file to a worker, each training fixture made once for both,
# tests/conftest.py): their tests mostly wait on the processes they start.
test: $(STAMP) browser
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -m "not slow" --timeout 120 -n 2 --durations 15
	$(PYTHON) -m pytest -q -m slow --timeout 900 -n 2 --dist loadfile --durations 60

lint: $(STAMP)
	$(PYTHON) -m ruff check .

bench: $(STAMP)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,bench]"
	$(PYTHON) -m benchmarks --sizes small,medium,large --repeats 3
