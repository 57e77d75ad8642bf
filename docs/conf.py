"""Sphinx configuration of the documentation site (MyST markdown pages, an executed tutorial,
the API reference from the docstrings). Build: pip install -e '.[docs]' && sphinx-build -W
--keep-going -b html docs docs/_build/html"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

project = "sparse_jax"
author = "the sparse_jax developers"
copyright = "2026, the sparse_jax developers"  # noqa: A001  (Sphinx's name)
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
# Result tables, studies and figures are read by the pages, not pages themselves.
exclude_patterns = ["_build", "benchmarks/**", "pattern_study/**", "long_context/**",
                    "images/**", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# The tutorial runs at every build; an error in a cell fails the build.
nb_execution_mode = "force"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True  # a training run's lines as one output, not one box per line

autodoc_member_order = "bysource"
autodoc_preserve_defaults = True  # xp=np, not the repr of the numpy module
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}


def _literal_bars(app, what, name, obj, options, lines):
    """The docstrings write a pattern's key set as |S| (the paper's notation), which
    reStructuredText would read as a substitution."""
    lines[:] = [line.replace("|S|", r"\|S\|") for line in lines]


def setup(app):
    app.connect("autodoc-process-docstring", _literal_bars)

html_theme = "furo"
html_title = "sparse_jax"
html_static_path = []
