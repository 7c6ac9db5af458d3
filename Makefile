# lowprec: `make book` builds the site, `make test` runs every test, `make lab` opens the notebooks.
# Each target first makes sure .venv exists and holds requirements.txt (a stamp file skips the work
# when nothing changed).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup book test lab lint clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	touch $(STAMP)

setup: $(STAMP)

# The execution cache is keyed on the chapters' text only: when the library changes, re-execute them all.
JUPYTER_CACHE := _build/.jupyter_cache/global.db
book: setup
	@if [ -f $(JUPYTER_CACHE) ] && [ -n "$$(find lib -name '*.py' -newer $(JUPYTER_CACHE) | head -1)" ]; then \
		rm -rf $(dir $(JUPYTER_CACHE)); fi
	BOOK_BUILD=1 TRITON_INTERPRET=1 $(VENV)/bin/jupyter-book build -W -n --keep-going .

test: setup
	$(PY) -m ruff check lib tests book _ext
	TRITON_INTERPRET=1 $(PY) -m pytest -q

# JupyterLab opens the MyST chapters (book/*.md) as notebooks (jupytext) rather than as text files.
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
lab: setup
	mkdir -p $(dir $(LAB_OVERRIDES))
	echo '{"@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}}}' > $(LAB_OVERRIDES)
	TRITON_INTERPRET=1 $(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) book/

lint: setup
	$(PY) -m ruff check lib tests book _ext

clean:
	rm -rf _build
