"""The "In your own model" code block of docs/attention.md (the page the README sends users to
for the attention API) runs as printed, gives the shapes and dtypes its comments state, and its
attention equals the dense masked reference."""

import os
import re

import jax.numpy as jnp
import numpy as np

from sparse_jax.attention import dense_attention

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                      "attention.md")
SECTION = "## In your own model"


def readme_block() -> str:
    """The first ```python block of the section."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert SECTION in text, f"docs/attention.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the section has no ```python block"
    return match.group(1)


def test_attention_example_runs_as_printed():
    code = readme_block()
    # What the comments state, so that the block and this test cannot drift apart.
    assert "# [2, 1024, 4, 32] bf16" in code and "# [2, 1024, 128] float32" in code
    namespace = {"__name__": "readme_example"}
    exec(compile(code, README, "exec"), namespace)
    out, y = namespace["out"], namespace["y"]
    assert out.shape == (2, 1024, 4, 32) and out.dtype == jnp.bfloat16
    assert y.shape == (2, 1024, 128) and y.dtype == jnp.float32

    q, k, v = (namespace[name].astype(jnp.float32) for name in "qkv")
    reference = dense_attention(q, k, v, namespace["spec"].mask(q.shape[1]))
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, atol=3e-2)
