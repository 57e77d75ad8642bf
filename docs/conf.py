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

# The tutorial runs at every build; an error in a cell fails the build. Its training cell (200
# steps) takes under a minute on an idle 2-core CPU and three times that on a loaded one: the
# per-cell limit only catches a hang.
nb_execution_mode = "force"
nb_execution_timeout = 1800
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


def _module_signature(app, what, name, obj, options, signature, return_annotation):
    """Flax NNX modules are built through a metaclass whose ``__call__`` takes
    ``(*args, **kwargs)``: show their ``__init__``'s parameters instead, defaults as written."""
    import inspect

    from flax import nnx
    from sphinx.ext.autodoc.preserve_defaults import update_defvalue
    from sphinx.util.inspect import stringify_signature

    if what == "class" and isinstance(obj, type) and issubclass(obj, nnx.Module):
        update_defvalue(app, obj.__init__, bound_method=False)  # dtype=jnp.float32, not a repr
        init = inspect.signature(obj.__init__)
        init = init.replace(parameters=list(init.parameters.values())[1:])  # no self
        return stringify_signature(init, show_annotation=False), return_annotation
    return None


def setup(app):
    app.connect("autodoc-process-docstring", _literal_bars)
    app.connect("autodoc-process-signature", _module_signature)

html_theme = "furo"
html_title = "sparse_jax"
html_static_path = ["_static"]
html_css_files = ["wrap_outputs.css"]  # long training-log lines wrap inside their box


def _encrypted_kernel():
    """ipykernel 7.4 warns on every start that its TCP sockets are not encrypted: the tutorial's
    kernel gets CurveZMQ keys where pyzmq has them (it runs on this machine only either way)."""
    try:
        import zmq
        from jupyter_client.manager import KernelManager
    except ImportError:
        return
    if zmq.has("curve") and "transport_encryption" in KernelManager.class_trait_names():
        KernelManager.transport_encryption.default_value = "auto"


_encrypted_kernel()
