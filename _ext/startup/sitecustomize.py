"""Imported by every Python process that `make book`, `make test` and `make lab` start (the Makefile puts this
folder first on PYTHONPATH): the chapters' kernels, the tests, jupyter-book and JupyterLab.

jsonschema, which nbformat and JupyterLab import, imports its optional IRI format checker `rfc3987_syntax`
when that is installed (jupyter-events' dependencies install it), and that import builds a grammar: about 2 s
of CPU in each of the ~30 processes of a test run. Nothing here validates an IRI, so the checker is left out.
"""

import sys

sys.modules.setdefault("rfc3987_syntax", None)  # its import now raises ImportError, which jsonschema skips
