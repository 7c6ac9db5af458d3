# lowprec: `make book` builds the site, `make test` runs every test, `make lab` opens the notebooks.
# Each target first makes sure .venv exists and holds requirements.txt (a stamp file skips the work
# when nothing changed).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup clear-stale book test lab lint clean

# Every Python process these targets start imports _ext/startup/sitecustomize.py (it spares them an unused
# 2-second import); a PYTHONPATH of your own stays after it.
export PYTHONPATH := $(abspath _ext/startup)$(if $(PYTHONPATH),:$(PYTHONPATH))

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	touch $(STAMP)

setup: $(STAMP)

# The execution cache is keyed on the chapters' text only, and Sphinx re-reads only the chapters whose text
# changed: when the library or a recorded result is newer than the last build, drop both (so the site never
# shows outputs computed from an old library or record), and the run cache with them. The protocols
# (results/*/PROTOCOL.md, written before every GPU run) are cited by the chapters, never read by them, so they
# do not count. The chapters the cache lacks are executed first, two at a time on one thread each
# (_ext/execute_chapters.py); the build then renders them from the cache.
LAST_BUILD := _build/.doctrees/environment.pickle
# The pages read the same ~150 run records: the first process to parse one keeps it here for the others.
RUN_CACHE := _build/run-cache
export LOWPREC_RUN_CACHE ?= $(abspath $(RUN_CACHE))

# Any process that reads records meanwhile (a JupyterLab kernel, the tests) may keep a run in the run cache,
# and `rm -rf` of a folder that gains a file fails ("Directory not empty"): the folder is moved aside first (no
# new file can reach it then) and removed there.
clear-stale:
	@if [ -f $(LAST_BUILD) ] && [ -n "$$( { find lib -name '*.py' -newer $(LAST_BUILD); \
		find results -type f ! -name PROTOCOL.md -newer $(LAST_BUILD); } | head -1)" ]; then \
		rm -rf _build/.jupyter_cache _build/.doctrees $(RUN_CACHE).old; \
		if [ -d $(RUN_CACHE) ]; then mv $(RUN_CACHE) $(RUN_CACHE).old && rm -rf $(RUN_CACHE).old; fi; fi

book: setup clear-stale
	BOOK_BUILD=1 TRITON_INTERPRET=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) _ext/execute_chapters.py \
		--cache _build/.jupyter_cache --jobs 2 book/*.md
	BOOK_BUILD=1 TRITON_INTERPRET=1 $(VENV)/bin/jupyter-book build -W -n --keep-going .

# Two workers, one file at a time each, in collection order; tests/conftest.py puts tests/test_book.py first, so
# that the site build (the longest single job: it executes every chapter) starts at once on one worker. One
# thread per process: the tensors are small, and two workers plus the build's chapters already fill two cores
# (with torch's default of one thread per core they would wait on each other).
test: setup
	$(PY) -m ruff check lib tests book _ext
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile \
		--no-loadscope-reorder

# JupyterLab opens the MyST chapters (book/*.md) as notebooks (jupytext) rather than as text files, through
# _ext/lab_contents.py: cells the site hides (hide-input, remove-cell, ...) open collapsed, and a save writes a
# chapter only when its text changed, so running a chapter changes no file in book/ and autosave (every few
# seconds) leaves it marked saved; edited cells are saved as usual. The lab's settings (LAB_SETTINGS) and
# the terminals' rc file live in _build/lab, checkpoints in _build/lab-checkpoints. Kernels run compiled on a
# CUDA machine and under the Triton interpreter elsewhere. The lab's kernels and terminals have $(VENV)/bin
# first on PATH (terminals source LAB_BASHRC after ~/.bashrc, since a login shell's /etc/profile would reset
# PATH), so the README's `lowprec ...` commands work there. LAB_ARGS adds options (tests/test_lab.py: port,
# token, no browser).
LAB_DIR := _build/lab
LAB_SETTINGS := {"@jupyterlab/docmanager-extension:plugin": {"autosave": true, "autosaveInterval": 3, \
	"defaultViewers": {"markdown": "Jupytext Notebook", "myst": "Jupytext Notebook"}}}
LAB_BASHRC := $(LAB_DIR)/bashrc
LAB_ARGS ?=
VENV_BIN := $(abspath $(VENV))/bin
lab: setup
	mkdir -p $(LAB_DIR)/settings _build/lab-checkpoints
	echo '$(LAB_SETTINGS)' > $(LAB_DIR)/settings/overrides.json
	printf '%s\n' '[ -f ~/.bashrc ] && . ~/.bashrc' 'PATH="$(VENV_BIN):$$PATH"' > $(LAB_BASHRC)
	if ! $(PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then \
		export TRITON_INTERPRET=1; fi; \
	PATH="$(VENV_BIN):$$PATH" PYTHONPATH="$(abspath _ext)$${PYTHONPATH:+:$$PYTHONPATH}" \
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) \
		--ServerApp.contents_manager_class=lab_contents.ChapterContentsManager \
		--LabApp.app_settings_dir=$(abspath $(LAB_DIR)/settings) \
		--ServerApp.terminado_settings="shell_command=['$(SHELL)','--rcfile','$(abspath $(LAB_BASHRC))']" \
		--FileCheckpoints.checkpoint_dir=$(abspath _build/lab-checkpoints) $(LAB_ARGS) book/

lint: setup
	$(PY) -m ruff check lib tests book _ext

clean:
	rm -rf _build
