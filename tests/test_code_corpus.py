"""The shipped code corpus (data/cpython_lib.py.gz) is vouched for as the bible is: its checksums
are listed, a damaged .gz is a one-line error naming the file and how to restore it, a changed
decompressed copy is decompressed again; the configs/code.py presets read it."""

import os
import shutil

import numpy as np

import configs
from conftest import one_line_error
from sparse_jax.data import sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data")


def shipped_copy(tmp_path):
    """The corpus and its SHA256SUMS copied into tmp_path (the repository's own are never
    touched); returns the path of the .gz copy."""
    for name in ("cpython_lib.py.gz", "SHA256SUMS"):
        shutil.copy(os.path.join(DATA, name), tmp_path / name)
    return str(tmp_path / "cpython_lib.py.gz")


def test_the_shipped_code_corpus_loads_and_a_damaged_copy_is_one_line(tmp_path):
    gz = shipped_copy(tmp_path)
    data = sources.load_bytes(gz)
    assert len(data) == 12_145_142  # data/README.md
    head = bytes(data[:200])
    assert head.startswith(b"# ==== Lib/")
    with open(os.path.join(DATA, "cpython_lib.files.txt")) as f:
        assert len(f.read().split()) == 734
    assert os.path.exists(os.path.join(DATA, "LICENSE-PSF.txt"))
    # The decompressed cache damaged (a new mtime, as an editor leaves it): decompressed again.
    cache = tmp_path / "cpython_lib.py"
    before = int(data[6_000_000])
    del data
    with open(cache, "r+b") as f:
        f.seek(6_000_000)
        f.write(bytes([before ^ 1]))
    os.utime(cache, ns=(1, 1))
    assert int(sources.load_bytes(gz)[6_000_000]) == before
    # The .gz damaged: one line naming it and how to restore it; nothing written beside it.
    os.remove(cache)
    for name in os.listdir(tmp_path):
        if name not in ("cpython_lib.py.gz", "SHA256SUMS"):
            os.remove(tmp_path / name)
    raw = bytearray(open(gz, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(gz, "wb").write(bytes(raw))
    one_line_error(ValueError, lambda: sources.load_bytes(gz), gz, "damaged", "git checkout")
    assert sorted(os.listdir(tmp_path)) == ["SHA256SUMS", "cpython_lib.py.gz"]


def test_code_presets_read_the_code_corpus_and_differ_only_in_context():
    short, long = (configs.load(f"code:size={s}") for s in ("short", "long"))
    assert short.data.path == long.data.path == "data/cpython_lib.py.gz"
    assert (short.model.seq_len, long.model.seq_len) == (512, 4096)
    # The same model: shifted heads, one per shift 1..l, so one hop reaches every earlier byte.
    assert long.model.shifted_heads and long.model.num_heads >= long.model.stride
    assert 0 < long.model.rotary_fraction < 1  # part of each head matches at any distance
    for field in ("num_layers", "d_model", "num_heads", "stride", "local_width", "mode",
                  "shifted_heads", "rotary", "rotary_fraction", "pos_emb", "pattern"):
        assert short.model[field] == long.model[field], field
    assert np.all([until < long.total_steps for until, _, _ in long.context_stages])
    # The first presets: the long one's local window spans its stride (two hops reach all).
    paper = configs.load("code:size=long,heads=paper")
    assert paper.model.local_width is None and paper.model.stride == 64
    assert not paper.model.shifted_heads
