#!/usr/bin/env bash
# Downloads into .whl/ (git ignores it) the wheels of the notebook stack that the GPU machine's image lacks, at
# the versions of this checkout's .venv, for its Python 3.12 (the chapters' GPU test needs them:
# scripts/h200-chapters.sh installs them there). Run here, in the repository root; ~25 MB.
set -eu
PACKAGES="asttokens comm debugpy executing fastjsonschema ipykernel ipython ipython_pygments_lexers ipywidgets
  jedi jsonschema jsonschema-specifications jupyter_client jupyter_core jupyterlab_widgets jupytext
  matplotlib-inline mdit-py-plugins nbclient nbformat nest-asyncio2 parso pexpect platformdirs plotly
  prompt_toolkit ptyprocess pure_eval pyzmq referencing rpds-py stack-data tornado traitlets wcwidth
  widgetsnbextension"
pins=()
for name in $PACKAGES; do
  version=$(.venv/bin/python -m pip show "$name" 2> /dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "$name is not in .venv (make setup first)" >&2; exit 1; }
  pins+=("$name==$version")
done
mkdir -p .whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}" 2>&1 | grep -v "^WARNING: Location" || true
ls .whl | wc -l
du -sh .whl
