"""The larger code corpus's build (`sparse_jax.data.code_corpus`, scripts/build_code_corpus.py), on
tiny sdists made here (real .tar.gz files with a PKG-INFO, a LICENSE, .py files, tests and files
that are not text), read from a folder, no network: the layout (headers, path order, tests and
non-UTF-8 files left out), the checksums and the loader's check of them, the licence record,
and one-line refusals of a non-permissive licence, a wrong sha256, a missing sdist and an output
that cannot be written; a write that fails (a full disk at the last byte, a rename) leaves what
was there before, whole."""

import email
import errno
import gzip
import hashlib
import io
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import files_in, one_line_error
from sparse_jax.data import code_corpus, sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNREACHABLE = "http://127.0.0.1:9/simple/{name}/"  # the discard port: refused at once

ALPHA = {  # path in the sdist -> bytes
    "alpha/__init__.py": b"from alpha.core import f\n",
    "alpha/core.py": b"def f():\n    return 1",  # no final newline: one is added
    "alpha/tests/test_core.py": b"assert True\n",
    "alpha/testing.py": b"# helpers for tests: a part named test*\n",
    "alpha/latin1.py": "# caf\u00e9\n".encode("latin-1"),  # not UTF-8: skipped
    "alpha/blob.py": b"\x00\x01\x02",  # binary: skipped
    "alpha/data.txt": b"not python\n",
    "docs/conf.py": b"project = 'alpha'\n",
}
BETA = {
    "src/beta/util.py": b"X = '\xc3\xa9'\n",  # UTF-8: kept
    "src/beta/Tests/check.py": b"pass\n",  # "Tests": case-insensitive
    "test_beta.py": b"pass\n",
    "src/beta/LICENSE.vendored": b"vendored: MIT\n",
    "LICENSES/Apache-2.0.txt": b"Apache License\n",
}


def sdist(folder, name, version, files, metadata="License-Expression: MIT\n"):
    """A real sdist `<name>-<version>.tar.gz` in `folder` (top folder `<name>-<version>/`, a
    PKG-INFO with `metadata`, a LICENSE and `files`); returns its pin."""
    top = f"{name}-{version}"
    members = {"PKG-INFO": (f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n"
                            f"{metadata}").encode(),
               "LICENSE": f"The licence of {name}.\n".encode(), **files}
    path = folder / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as t:
        for inner, data in members.items():
            info = tarfile.TarInfo(f"{top}/{inner}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return code_corpus.Pin(name, version, path.name, digest)


def write_pins(path, pins):
    path.write_text("# test pins\n" + "".join(f"{p.name}=={p.version}  {p.filename}  "
                                              f"{p.sha256}  # a comment\n" for p in pins))
    return str(path)


@pytest.fixture
def tiny(tmp_path):
    """(pins file, sdist folder, output path) of two tiny sdists, beta listed first."""
    folder = tmp_path / "sdists"
    folder.mkdir()
    pins = [sdist(folder, "beta", "0.2", BETA, "License: BSD\nLicense-File: LICENSE\n"),
            sdist(folder, "alpha", "1.0", ALPHA)]
    return write_pins(tmp_path / "pins.txt", pins), str(folder), str(tmp_path / "out" / "c.py.gz")


def test_the_corpus_holds_each_py_file_after_its_header_in_path_order(tiny):
    pins, folder, output = tiny
    built = code_corpus.build(pins, folder, output, download=False)
    with gzip.open(output) as f:
        raw = f.read()
    assert raw == (b"# ==== alpha-1.0/alpha/__init__.py ====\nfrom alpha.core import f\n"
                   b"# ==== alpha-1.0/alpha/core.py ====\ndef f():\n    return 1\n"
                   b"# ==== alpha-1.0/docs/conf.py ====\nproject = 'alpha'\n"
                   b"# ==== beta-0.2/src/beta/util.py ====\nX = '\xc3\xa9'\n")
    assert built["files"] == 4 and built["bytes"] == len(raw)
    assert [(p["package"], p["licence"], p["licence_source"], p["skipped"])
            for p in built["packages"]] == [
        ("beta-0.2", "BSD", "License", []),
        ("alpha-1.0", "MIT", "License-Expression", ["alpha/blob.py", "alpha/latin1.py"])]
    out = os.path.dirname(output)
    with open(os.path.join(out, "c.files.txt")) as f:
        assert f.read() == ("alpha-1.0/alpha/__init__.py\tMIT\nalpha-1.0/alpha/core.py\tMIT\n"
                            "alpha-1.0/docs/conf.py\tMIT\nbeta-0.2/src/beta/util.py\tBSD\n")
    with open(os.path.join(out, "c.licenses.txt")) as f:
        licences = f.read()
    assert "==== beta-0.2: BSD (License) ====" in licences
    assert "==== alpha-1.0: MIT (License-Expression) ====" in licences
    assert "---- alpha-1.0/LICENSE ----\nThe licence of alpha." in licences
    assert "---- beta-0.2/src/beta/LICENSE.vendored ----\nvendored: MIT" in licences
    assert "---- beta-0.2/LICENSES/Apache-2.0.txt ----\nApache License" in licences
    # The checksum lines, in sha256sum's format, are those of the files.
    gz_sha = hashlib.sha256(open(output, "rb").read()).hexdigest()
    raw_sha = hashlib.sha256(raw).hexdigest()
    with open(os.path.join(out, "c.sha256")) as f:
        assert f.read() == f"{gz_sha}  c.py.gz\n{raw_sha}  c.py\n"
    assert (built["sha256"], built["gz_sha256"]) == (raw_sha, gz_sha)
    # Deterministic: a second build writes the very same .gz.
    again = code_corpus.build(pins, folder, output[:-6] + "2.py.gz", download=False)
    assert again["gz_sha256"] == gz_sha


def test_the_loader_checks_a_build_against_sha256sums(tiny):
    pins, folder, output = tiny
    built = code_corpus.build(pins, folder, output, download=False)
    out = os.path.dirname(output)
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        f.write(f"{built['sha256']}  c.py\n")
    assert bytes(sources.load_bytes(output)).startswith(b"# ==== alpha-1.0/alpha/__init__.py")
    # Listed with other bytes: the loader refuses the build, and a rebuild fails before writing.
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        f.write(f"{'0' * 64}  c.py\n")
    os.remove(output[:-3])  # the decompressed copy, so that it is made again
    one_line_error(ValueError, lambda: sources.load_bytes(output), "c.py")
    os.remove(output)
    one_line_error(ValueError, lambda: code_corpus.build(pins, folder, output, download=False),
                   "SHA256SUMS expects 000000000000", built["sha256"])
    assert not os.path.exists(output)


@pytest.mark.parametrize("metadata, licence", [
    ("License-Expression: GPL-3.0-only\n", "GPL-3.0-only"),
    ("License-Expression: MIT AND MPL-2.0\n", "MIT AND MPL-2.0"),
    ("License: GPL\n", "GPL"),
    ("License: GPLv3+\nClassifier: License :: OSI Approved :: MIT License\n", "GPLv3+"),
    ("Classifier: License :: OSI Approved :: GNU General Public License v3 (GPLv3)\n",
     "GNU General Public License v3 (GPLv3)")])
def test_a_package_without_a_permissive_licence_is_refused(tmp_path, tiny, metadata, licence):
    pins, folder, output = tiny
    gamma = sdist(tmp_path / "sdists", "gamma", "2.0", {"gamma.py": b"x = 1\n"}, metadata)
    with open(pins, "a") as f:
        f.write(f"{gamma.name}=={gamma.version}  {gamma.filename}  {gamma.sha256}\n")
    one_line_error(ValueError, lambda: code_corpus.build(pins, folder, output, download=False),
                   "gamma-2.0", licence, "not permissive")
    assert not os.path.exists(os.path.dirname(output))


def test_licences_read_from_metadata():
    meta = email.message_from_string
    assert code_corpus.licence_of(meta("License-Expression: Apache-2.0\nLicense: GPL\n")) == (
        "Apache-2.0", "License-Expression")
    assert code_corpus.licence_of(meta("License: Apache License, Version 2.0\n")) == (
        "Apache-2.0", "License")
    assert code_corpus.licence_of(meta("License: BSD-3-Clause\n")) == ("BSD-3-Clause", "License")
    assert code_corpus.licence_of(meta(  # a License field with a whole text: classifiers decide
        "License: Copyright (c) 2020 somebody. Permission is hereby granted, free of charge, to "
        "any person\nClassifier: License :: OSI Approved :: MIT License\n")) == (
        "MIT", "classifiers")
    one_line_error(ValueError, lambda: code_corpus.licence_of(meta("Name: x\n"), "x-1"), "x-1")
    for permissive in ("MIT", "BSD-3-Clause OR GPL-2.0", "(MIT OR Apache-2.0) AND BSD-2-Clause",
                       "Apache-2.0 WITH LLVM-exception", "PSF-2.0", "ISC", "MIT / BSD"):
        assert code_corpus.is_permissive(permissive), permissive
    for other in ("GPL-3.0-or-later", "MIT AND LGPL-2.1", "(MIT OR GPL-2.0) AND MPL-2.0",
                  "MIT / GNU General Public License v2 (GPLv2)", "", "Other/Proprietary License"):
        assert not code_corpus.is_permissive(other), other


def test_an_sdist_whose_sha256_differs_from_its_pin_is_refused(tiny):
    pins, folder, output = tiny
    with open(os.path.join(folder, "alpha-1.0.tar.gz"), "ab") as f:
        f.write(b"\0")
    one_line_error(ValueError, lambda: code_corpus.build(pins, folder, output, download=False),
                   "alpha-1.0.tar.gz", "delete it")
    assert not os.path.exists(os.path.dirname(output))


def test_a_missing_sdist_says_what_to_download_and_where(tiny):
    pins, folder, output = tiny
    os.remove(os.path.join(folder, "alpha-1.0.tar.gz"))
    os.remove(os.path.join(folder, "beta-0.2.tar.gz"))
    message = one_line_error(
        FileNotFoundError, lambda: code_corpus.build(pins, folder, output, index_url=UNREACHABLE),
        "2 of 2 sdists", "PyPI could not be reached", "beta-0.2.tar.gz",
        "https://pypi.org/project/beta/0.2/#files", "1 more named in", f"into {folder}/")
    assert "127.0.0.1" in message
    # The script offline: one `error:` line, status 1.
    proc = subprocess.run([sys.executable, "scripts/build_code_corpus.py", f"--pins={pins}",
                           f"--sdists={folder}", f"--output={output}", "--nodownload"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: 2 of 2 sdists")
    assert "downloads are off" in proc.stderr
    assert not os.path.exists(os.path.dirname(output))


def test_the_shipped_pins_parse_and_a_bad_line_is_named(tmp_path):
    pins = code_corpus.read_pins(os.path.join(ROOT, code_corpus.PINS))
    assert 20 <= len(pins) <= 60 and all(p.filename.endswith(".tar.gz") for p in pins)
    # The committed files list is in path order, of the pinned packages, all permissive.
    with open(os.path.join(ROOT, "data", "code_corpus.files.txt")) as f:
        rows = [line.rstrip("\n").split("\t") for line in f]
    paths = [path for path, _ in rows]
    assert paths == sorted(paths) and not any(map(code_corpus.excluded, paths))
    assert {path.split("/")[0] for path in paths} == {p.label for p in pins}
    assert all(code_corpus.is_permissive(licence) for _, licence in rows)
    with open(os.path.join(ROOT, "data", "SHA256SUMS")) as f:
        assert "  code_corpus.py\n" in f.read()  # the loader checks a build
    bad = tmp_path / "pins.txt"
    bad.write_text("alpha==1.0  alpha-1.0.tar.gz  abc\n")
    one_line_error(ValueError, lambda: code_corpus.read_pins(str(bad)), "pins.txt:1", "sha256")


def _build(pins, folder, output):
    return lambda: code_corpus.build(pins, folder, output, download=False)


def test_an_output_that_cannot_be_written_is_refused_before_anything(tiny, tmp_path,
                                                                     monkeypatch):
    # A folder named like the corpus: the build wrote c.files.txt, c.licenses.txt and a
    # c.sha256 listing a corpus never written, then failed naming a .tmp path.
    pins, folder, output = tiny
    out = tmp_path / "out"
    (out / "c.py.gz").mkdir(parents=True)
    before = sorted(os.listdir(out))
    one_line_error(ValueError, _build(pins, folder, output), f"{output} is a folder",
                   "give --output the path of a .py.gz file")
    (out / "c.py.gz").rmdir()
    (out / "c.sha256").mkdir()  # a record's path: refused as well, before anything
    one_line_error(ValueError, _build(pins, folder, output), "c.sha256 is a folder")
    assert sorted(os.listdir(out)) == ["c.sha256"] and before == ["c.py.gz"]
    (tmp_path / "a_file").write_text("mine\n")
    one_line_error(ValueError, _build(pins, folder, str(tmp_path / "a_file" / "d" / "c.py.gz")),
                   f"{tmp_path / 'a_file'} is not a folder", "choose another --output")
    with monkeypatch.context() as m:  # a folder this user cannot write in (the suite may be root)
        m.setattr(os, "access", lambda path, mode: False)
        one_line_error(ValueError, _build(pins, folder, str(tmp_path / "new" / "c.py.gz")),
                       f"{tmp_path} is not a folder this user can write in")
    assert sorted(os.listdir(tmp_path)) == ["a_file", "out", "pins.txt", "sdists"]
    # The script: one `error:` line, status 1, nothing written
    (out / "c.sha256").rmdir()
    (out / "c.py.gz").mkdir()
    proc = subprocess.run([sys.executable, "scripts/build_code_corpus.py", f"--pins={pins}",
                           f"--sdists={folder}", f"--output={output}", "--nodownload"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: --output={output} is a folder")
    assert sorted(os.listdir(out)) == ["c.py.gz"] and not os.listdir(out / "c.py.gz")


def _failing(monkeypatch, name, fails):
    """os.`name` raising a full disk's OSError on the calls `fails(args)` picks."""
    real = getattr(os, name)

    def fake(*args):
        if fails(args):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(os, name, fake)


def test_a_failure_at_the_last_write_leaves_nothing_written(tiny, tmp_path, monkeypatch):
    pins, folder, output = tiny
    calls = []  # the fourth flush to the disk is the last file's (the checksums')
    _failing(monkeypatch, "fsync", lambda args: calls.append(args) or len(calls) == 4)
    message = one_line_error(OSError, _build(pins, folder, output), "could not write",
                             "c.sha256", "the disk is full", "nothing was written")
    assert ".part" not in message and len(calls) == 4
    assert sorted(os.listdir(tmp_path)) == ["pins.txt", "sdists"]  # not even the folder


def test_a_failed_rebuild_leaves_the_build_before_it_whole(tiny, tmp_path, monkeypatch):
    pins, folder, output = tiny
    out = tmp_path / "out"
    code_corpus.build(pins, folder, output, download=False)
    (out / "c.files.txt").write_text("an older files list\n")  # to tell the builds apart
    before = files_in(out)
    # The corpus and two records already renamed into place when the last rename fails: every
    # file goes back to what it held.
    _failing(monkeypatch, "replace", lambda args: args[1].endswith("c.sha256"))
    one_line_error(OSError, _build(pins, folder, output), "could not write", "c.sha256")
    assert files_in(out) == before and sorted(os.listdir(out)) == sorted(before)
    monkeypatch.undo()
    # and the first write failing, the same
    _failing(monkeypatch, "fsync", lambda args: True)
    one_line_error(OSError, _build(pins, folder, output), "could not write", "c.py.gz")
    assert files_in(out) == before and sorted(os.listdir(out)) == sorted(before)
