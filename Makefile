# Training at Scale: build the book, open it in JupyterLab, or check everything.
# A fresh machine needs only Python >= 3.11 and access to the package registries.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: book site serve lab test lint unit-and-notebooks site-check browser chromium clean

# Create the virtual environment and install the pinned requirements (once, or
# again whenever requirements.txt or pyproject.toml change).
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11 or newer is needed"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $@

## make book: build the website and serve it on http://127.0.0.1:8000 (Ctrl-C stops it)
book: site serve

site: $(STAMP)
	$(BIN)/jupyter-book build . --keep-going

serve:
	@echo "Serving the book on http://$(HOST):$(PORT)/ (Ctrl-C to stop)"
	$(BIN)/python -m http.server $(PORT) --bind $(HOST) --directory _build/html

## make lab: JupyterLab on the notebooks, listening on 127.0.0.1 only
lab: $(STAMP)
	$(BIN)/jupyter lab --ip=$(HOST) --notebook-dir=notebooks

## make test: everything that checks the book
test: lint unit-and-notebooks site-check browser

lint: $(STAMP)
	$(BIN)/ruff check src tests notebooks
	$(BIN)/ruff format --check src tests notebooks

# Unit and property tests, the committed-notebook checks, and nbval strict:
# every notebook cell re-run and its text output compared with what is stored.
unit-and-notebooks: $(STAMP)
	$(BIN)/python -m pytest tests notebooks --ignore=tests/browser --nbval --nbval-current-env \
		--nbval-sanitize-with tests/sanitize.cfg

# The website from a clean _build, with every Sphinx warning an error.
site-check: $(STAMP)
	rm -rf _build
	$(BIN)/jupyter-book build . -n -W --keep-going

# The built site (and JupyterLab) in headless Chromium, as a reader would use them.
browser: $(STAMP) chromium
	$(BIN)/python -m pytest tests/browser

# Debian's Chromium for the browser tests, installed if missing (needs root or sudo).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		echo "Installing Debian's chromium for the browser tests"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium; }

clean:
	rm -rf _build
