# Training at Scale: build the book, open it in JupyterLab, or check everything.
# A fresh machine needs only Python >= 3.11 and access to the package registries.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: book site serve lab test check lint unit notebooks nbval nbval-alone site-check browser \
	bench chromium clean

# The PyTorch version the book pins, and where its CPU-only build is published.
TORCH_VERSION   := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The installer's own pins. uv fills a venv with the same pinned set as pip, from its
# cache in seconds (pip: about a minute), and compiles it to bytecode as pip does (else
# every process of the first test run would compile torch again); `make INSTALLER=pip
# ...` uses pip alone, and so does a machine where uv cannot be installed.
UV_VERSION  := 0.13.9
PIP_VERSION := 26.3
INSTALLER   ?= uv
# Folders of wheels pip is told to look in (PIP_FIND_LINKS or pip's config), given to
# uv too: uv reads neither.
FIND_LINKS = $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

# Create the virtual environment and install the pinned requirements (once, or
# again whenever requirements.txt or pyproject.toml change). On Linux without an
# NVIDIA GPU, torch comes from the PyTorch CPU index first (PyPI's Linux wheel is
# a CUDA build of several GB); if that index cannot be reached, the installer gives
# up within seconds and the pinned requirements install as they are.
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed"'
	$(PYTHON) -m venv $(VENV)
	@if [ "$(INSTALLER)" = uv ] && $(BIN)/python -m pip install --quiet uv==$(UV_VERSION); then \
		echo "Installing with uv $(UV_VERSION)"; \
		install="$(BIN)/uv pip install --quiet --python $(BIN)/python \
			$(foreach folder,$(FIND_LINKS),--find-links $(folder))"; \
		cpu_index="env UV_HTTP_RETRIES=0 UV_HTTP_TIMEOUT=5 $$install --index-url"; \
		compile=--compile-bytecode; \
	else \
		echo "Installing with pip"; \
		install="$(BIN)/python -m pip install --quiet"; \
		cpu_index="$$install --timeout 5 --retries 0 --index-url"; \
		compile=; \
	fi; \
	set -e; \
	$$install pip==$(PIP_VERSION); \
	if [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "No NVIDIA GPU: installing the CPU build of torch $(TORCH_VERSION)"; \
		$$cpu_index $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION) \
		|| echo "The PyTorch CPU index is not reachable: torch comes from requirements.txt"; \
	fi; \
	$$install -r requirements.txt $$compile
	touch $@

## make book: build the website and serve it on http://127.0.0.1:8000 (Ctrl-C stops it)
book: site serve

# The "Plan your run" page's Pyodide (fetched from the npm registry once) and the planner's
# own .py files (packed from this tree every time): tools/plan_page.py.
site: $(STAMP)
	$(BIN)/python tools/plan_page.py
	$(BIN)/jupyter-book build . --keep-going

serve:
	@echo "Serving the book on http://$(HOST):$(PORT)/ (Ctrl-C to stop)"
	$(BIN)/python -m http.server $(PORT) --bind $(HOST) --directory _build/html

## make lab: JupyterLab on the notebooks, listening on 127.0.0.1 only
lab: $(STAMP)
	$(BIN)/jupyter lab --ip=$(HOST) --notebook-dir=notebooks

## make test: everything that checks the book
# The site build sends nothing through loopback, so chapter 6's byte count can run
# beside it; everything else runs one phase at a time (tools/bench.py times each).
test: lint release-lint unit nbval
	$(MAKE) --no-print-directory -j 2 --output-sync=target site-check nbval-alone
	$(MAKE) --no-print-directory browser

## make check: the inner loop while writing: lint and the fast unit tests (< 60 s)
check: lint
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not browser"

lint: $(STAMP)
	$(BIN)/ruff check src tests notebooks tools book
	$(BIN)/ruff format --check src tests notebooks tools book

# Unit and property tests (real gloo jobs included) and the committed-notebook
# checks, three at a time on two cores (many of them wait on other processes).
unit: $(STAMP)
	$(BIN)/python -m pytest -n 3 tests

# nbval strict: every notebook re-run and each text output (and SVG figure)
# compared with the stored one. The kernels run with torch's, MKL's and oneDNN's vector
# code forced to another instruction set than this machine's (plain C++ kernels,
# SSE4.2 BLAS), so a pass shows the stored outputs hold on other CPUs too
# (see CONTRIBUTING.md, "Outputs that hold on every CPU").
KERNELS_ELSEWHERE := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg
# Chapter 6 counts the bytes that cross the loopback interface during its all-reduces,
# so it runs alone: another notebook's gloo ranks would add their traffic to the count.
# The others run two at a time, longest first (by the run time each notebook stores),
# so that no long one starts last while the other worker has nothing left to do.
ALONE := notebooks/06_collectives.ipynb
notebooks: nbval nbval-alone
nbval: $(STAMP)
	$(KERNELS_ELSEWHERE) $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(NBVAL) \
		$(filter-out $(ALONE),$(shell $(BIN)/python tools/longest_first.py notebooks/*.ipynb book/*.ipynb))
nbval-alone: $(STAMP)
	$(KERNELS_ELSEWHERE) $(BIN)/python -m pytest $(NBVAL) $(ALONE)

# The website from a clean _build, with every Sphinx warning an error.
site-check: $(STAMP)
	rm -rf _build
	$(BIN)/python tools/plan_page.py
	$(BIN)/jupyter-book build . -n -W --keep-going

# The built site (and JupyterLab) in headless Chromium, as a reader would use them.
browser: $(STAMP) chromium
	$(BIN)/python -m pytest -n 2 -m browser tests/browser

## make bench: how long each part of the book takes to run on this machine
bench: $(STAMP)
	$(BIN)/python tools/bench.py

# Debian's Chromium for the browser tests, installed if missing (needs root or sudo).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		echo "Installing Debian's chromium for the browser tests"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

clean:
	rm -rf _build

## make ship-check: the release's metadata and packaging (no network once installed)
# CITATION.cff against the Citation File Format schema; the GitHub workflows with
# actionlint and zizmor (offline: no GitHub API calls); then the wheel built,
# installed into an empty venv and used there, and Binder's pins against
# requirements.txt (tests that `make unit` runs too, so `make test` runs only
# release-lint). cffconvert needs jsonschema<4, which Jupyter cannot have: it gets
# its own venv.
CFFCONVERT := $(VENV)/cffconvert
.PHONY: ship-check release-lint
ship-check: release-lint
	$(BIN)/python -m pytest -q tests/test_packaging.py tests/test_binder.py

release-lint: $(STAMP) $(CFFCONVERT)/.installed
	$(CFFCONVERT)/bin/cffconvert --validate --infile CITATION.cff
	$(BIN)/actionlint
	$(BIN)/zizmor --offline .github/workflows

$(CFFCONVERT)/.installed: requirements-cffconvert.txt $(STAMP)
	$(PYTHON) -m venv --without-pip $(CFFCONVERT)
	@if [ -x $(BIN)/uv ] && [ "$(INSTALLER)" = uv ]; then \
		$(BIN)/uv pip install --quiet --python $(CFFCONVERT)/bin/python -r requirements-cffconvert.txt; \
	else \
		$(PYTHON) -m venv $(CFFCONVERT) && \
		$(CFFCONVERT)/bin/python -m pip install --quiet -r requirements-cffconvert.txt; \
	fi
	touch $@
