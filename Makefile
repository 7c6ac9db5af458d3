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

book: setup
	BOOK_BUILD=1 TRITON_INTERPRET=1 $(VENV)/bin/jupyter-book build -W -n --keep-going .

test: setup
	$(PY) -m ruff check lib tests book
	TRITON_INTERPRET=1 $(PY) -m pytest -q

lab: setup
	TRITON_INTERPRET=1 $(VENV)/bin/jupyter lab book/

lint: setup
	$(PY) -m ruff check lib tests book

clean:
	rm -rf _build
