"""A larger source-code corpus, built reproducibly from pinned PyPI source distributions.

`build` turns the sdists named in a pins file (`data/code_corpus_pins.txt`: one
`name==version  filename  sha256` a line) into ONE byte file in the layout of the shipped
`data/cpython_lib.py.gz`: every `.py` file of every package in path order, each after one line
`# ==== <name>-<version>/<path> ====`, gzip -9'd. Beside it go `<stem>.files.txt` (each file and
its package's licence, tab-separated), `<stem>.licenses.txt` (per package: the licence its
metadata states and the licence files its sdist ships) and `<stem>.sha256` (the two checksum
lines, `sha256sum` format). data/README.md records what the shipped pins build.

- Sdists come from a cache folder (`data/sdists` by default; a user may fill it by hand) or are
  downloaded from PyPI (its simple index, PEP 691 JSON) into it; each is checked against the
  sha256 in the pins before it is read. Without network the build stops at once, naming what to
  download and where to put it.
- Tests are left out as they are in cpython_lib.py.gz: no path part named `test*`, `tests`,
  `idle_test` or `site-packages` (case-insensitive), file names included. A `.py` file that is
  not UTF-8 text (or holds a NUL byte) is skipped; a file not ending in a newline gets one, so
  every header starts a line.
- Only permissive licences are taken (`PERMISSIVE`): the licence is read from the sdist's
  PKG-INFO, License-Expression first, else a License field that names a licence, else the
  License classifiers; any other is refused in one line.
- The output is deterministic (gzip header without name or time). If the output folder's
  SHA256SUMS lists the decompressed file, a build whose bytes differ fails before anything is
  written; the loader (`sources.load_bytes`) checks the decompressed copy against the same line.
- Where it goes is checked first (`check_output`: no folder in the place of the corpus or a
  record, a folder this user can write in above them), before any download. The corpus and its
  records are written all or none (`write_all`): each in full under a temporary name, then
  renamed into place, the corpus first, the records after it; on any failure every path keeps
  what it held before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.parser
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile

from sparse_jax.data.sources import CHECKSUMS, DOWNLOAD_TIMEOUT_S
from sparse_jax.files import atomic_write, part_suffix, write_error

PINS = "data/code_corpus_pins.txt"
SDISTS = "data/sdists"  # ignored by git, as everything in data/ not listed in .gitignore
OUTPUT = "data/code_corpus.py.gz"
INDEX_URL = "https://pypi.org/simple/{name}/"  # PEP 691: JSON with each file's url and sha256
HEADER = "# ==== {path} ====\n"
EXCLUDED_PARTS = ("tests", "idle_test", "site-packages")  # and every part starting with "test"
LICENSE_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE")  # licence files, by name prefix

# SPDX ids (and, from free-text License fields and classifiers, family names) accepted.
PERMISSIVE = frozenset(s.lower() for s in (
    "MIT", "MIT-0", "MIT-CMU", "X11", "BSD", "BSD-2-Clause", "BSD-3-Clause", "0BSD",
    "Apache", "Apache-2.0", "PSF", "PSF-2.0", "Python-2.0", "ISC", "Zlib", "Unlicense",
    "CC0-1.0", "HPND", "BSL-1.0", "Unicode-3.0", "Unicode-DFS-2016"))
# Free-text License fields that name a licence, lowercased.
LICENSE_TEXTS = {
    "mit": "MIT", "mit license": "MIT", "bsd": "BSD", "bsd license": "BSD",
    "new bsd": "BSD-3-Clause", "new bsd license": "BSD-3-Clause", "3-clause bsd":
    "BSD-3-Clause", "bsd 3-clause": "BSD-3-Clause", "apache": "Apache", "apache 2.0":
    "Apache-2.0", "apache license 2.0": "Apache-2.0", "apache license, version 2.0": "Apache-2.0",
    "apache software license": "Apache", "apache software license 2.0": "Apache-2.0",
    "psf": "PSF", "psf license": "PSF", "python software foundation license": "PSF",
    "isc": "ISC", "isc license": "ISC", "gpl": "GPL", "lgpl": "LGPL", "mpl": "MPL"}
# License classifiers ("License :: OSI Approved :: <name>"): the permissive ones.
CLASSIFIERS = {
    "MIT License": "MIT", "MIT No Attribution License (MIT-0)": "MIT-0", "BSD License": "BSD",
    "Apache Software License": "Apache", "Python Software Foundation License": "PSF",
    "ISC License (ISCL)": "ISC", "zlib/libpng License": "Zlib", "The Unlicense (Unlicense)":
    "Unlicense", "Boost Software License 1.0 (BSL-1.0)": "BSL-1.0",
    "Historical Permission Notice and Disclaimer (HPND)": "HPND"}


@dataclasses.dataclass(frozen=True)
class Pin:
    name: str  # as PyPI spells the project; the headers' prefix is `<name>-<version>/`
    version: str
    filename: str  # the sdist's file name on PyPI
    sha256: str

    @property
    def label(self) -> str:
        return f"{self.name}-{self.version}"


@dataclasses.dataclass
class Package:
    pin: Pin
    licence: str  # an SPDX expression or a family name (`PERMISSIVE`)
    licence_source: str  # "License-Expression", "License" or "classifiers" of PKG-INFO
    files: dict[str, bytes]  # header path -> the bytes written after its header
    licence_texts: dict[str, str]  # path in the sdist (with the label) -> text
    skipped: list[str]  # .py files that are not UTF-8 text


def read_pins(path: str) -> list[Pin]:
    """The pins of `path`: `name==version  filename  sha256` lines; `#` starts a comment."""
    pins = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            name, sep, version = fields[0].partition("==")
            if (len(fields) != 3 or not sep or not name or not version
                    or not re.fullmatch(r"[0-9a-f]{64}", fields[2])):
                raise ValueError(f"{path}:{number}: expected 'name==version  filename  sha256' "
                                 f"(a sha256 of 64 lowercase hex digits), got {line.strip()!r}")
            pins.append(Pin(name, version, fields[1], fields[2]))
    if not pins:
        raise ValueError(f"{path} lists no sdists")
    labels = [p.label for p in pins]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{path} lists a package twice: {sorted(labels)}")
    return pins


# ---------------------------------------------------------------------------------------------
# Fetching and checking the sdists.


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _where(pin: Pin) -> str:
    return f"https://pypi.org/project/{pin.name}/{pin.version}/#files"


def _download(pin: Pin, dest: str, index_url: str) -> None:
    """Finds `pin.filename` on the PyPI simple index and downloads it to `dest`, checked against
    the pin's sha256 before it appears there."""
    name = re.sub(r"[-_.]+", "-", pin.name).lower()
    request = urllib.request.Request(index_url.format(name=name),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT_S) as response:
        files = json.load(response)["files"]
    url = next((f["url"] for f in files if f["filename"] == pin.filename), None)
    if url is None:
        raise ValueError(f"PyPI has no file {pin.filename} for {pin.name} (see {_where(pin)}); "
                         f"correct the pin")
    digest = hashlib.sha256()
    with atomic_write(dest, "wb", part_suffix(dest)) as out, \
            urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
        if digest.hexdigest() != pin.sha256:
            raise ValueError(f"{url} has sha256 {digest.hexdigest()[:12]}..., the pin says "
                             f"{pin.sha256[:12]}...; correct the pin")


def fetch(pins: list[Pin], folder: str, pins_path: str, download: bool = True,
          index_url: str = INDEX_URL) -> dict[str, str]:
    """{label: path} of every pinned sdist in `folder`, downloading the missing ones first
    (`download`); each is checked against its pin's sha256. The first failed download ends it:
    a one-line FileNotFoundError naming what to download and where to put it."""
    paths = {p.label: os.path.join(folder, p.filename) for p in pins}
    missing = [p for p in pins if not os.path.exists(paths[p.label])]
    reason = "downloads are off"
    while missing and download:
        try:
            os.makedirs(folder, exist_ok=True)
            _download(missing[0], paths[missing[0].label], index_url)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            host = urllib.parse.urlsplit(index_url).netloc
            reason = f"PyPI could not be reached ({getattr(e, 'reason', e)}; {host})"
            break
        missing.pop(0)
    if missing:
        first = missing[0]
        more = f" and {len(missing) - 1} more named in {pins_path}" if len(missing) > 1 else ""
        raise FileNotFoundError(
            f"{len(missing)} of {len(pins)} sdists are not in {folder}/ and {reason}: download "
            f"{first.filename} (sha256 {first.sha256[:12]}..., {_where(first)}){more} into "
            f"{folder}/, or run with network")
    for pin in pins:
        got = _sha256(paths[pin.label])
        if got != pin.sha256:
            raise ValueError(f"{paths[pin.label]} has sha256 {got[:12]}..., {pins_path} expects "
                             f"{pin.sha256[:12]}... for {pin.label}: a damaged or different "
                             "file; delete it (it is downloaded again) or correct the pin")
    return paths


# ---------------------------------------------------------------------------------------------
# Reading one sdist.


def _members(path: str):
    """(path inside the sdist without its top folder, bytes) of every regular file."""
    if path.endswith(".zip"):
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir():
                    yield info.filename.partition("/")[2], z.read(info)
        return
    with tarfile.open(path) as t:
        for member in t:
            if member.isfile():
                yield member.name.partition("/")[2], t.extractfile(member).read()


def excluded(path: str) -> bool:
    """Whether a path is left out as a test (cpython_lib.py.gz's rule)."""
    parts = [p.lower() for p in path.split("/")]
    return any(p.startswith("test") or p in EXCLUDED_PARTS for p in parts)


def _text(data: bytes) -> str | None:
    """`data` as text if it is UTF-8 without NUL bytes, else None."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\0" in text else text


def licence_of(metadata, label: str = "") -> tuple[str, str]:
    """(licence, which field said so) from a PKG-INFO message: License-Expression, else a
    License field shorter than 80 characters (a name: `LICENSE_TEXTS` maps the common ones to
    SPDX; an unknown one is refused by `is_permissive`), else the License classifiers (also when
    the License field holds a whole licence text). ValueError if none says anything."""
    if expression := (metadata.get("License-Expression") or "").strip():
        return expression, "License-Expression"
    text = " ".join((metadata.get("License") or "").split())
    if text.lower() in LICENSE_TEXTS:
        return LICENSE_TEXTS[text.lower()], "License"
    if text.lower() not in ("", "unknown", "none") and len(text) < 80:
        return text, "License"  # a name or SPDX expression; a longer text is a licence's text
    names = [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or []
             if c.startswith("License ::") and c.count("::") >= 2]
    if names:
        return " / ".join(CLASSIFIERS.get(n, n) for n in names), "classifiers"
    raise ValueError(f"{label}: its PKG-INFO names no licence (no License-Expression, License "
                     "or License classifier); remove it from the pins")


def _ids(expression: str) -> list[str]:
    """The licence ids of an SPDX expression (operators and exceptions left out)."""
    expression = re.sub(r"\bWITH\s+\S+", "", expression.replace("(", " ").replace(")", " "))
    return [t for t in re.split(r"\s+|\s*/\s*", expression) if t and t not in ("AND", "OR")]


def is_permissive(licence: str) -> bool:
    """Whether every licence of `licence` is permissive; with `OR` (and no parentheses), one
    permissive alternative suffices."""
    if " OR " in licence and "(" not in licence:
        return any(is_permissive(alternative) for alternative in licence.split(" OR "))
    ids = _ids(licence)
    return bool(ids) and all(i.lower() in PERMISSIVE for i in ids)


def _is_licence_file(path: str) -> bool:
    """LICENSE*, COPYING*, NOTICE* or a file in a LICENSES folder, as text (not .svg, .rtf...)."""
    parts = path.upper().split("/")[-2:]
    return (any(p.startswith(LICENSE_NAMES) for p in parts)
            and not parts[-1].endswith((".SVG", ".RTF", ".HTML", ".PNG")))


def read_sdist(pin: Pin, path: str) -> Package:
    """The corpus files of one sdist, its licence (refused unless permissive) and the licence
    files that go with them: those its PKG-INFO lists (License-File), those at its top level or
    in a top-level LICENSES folder, and those in a folder that holds corpus files."""
    metadata, files, texts, skipped = None, {}, {}, []
    try:
        for inner, data in _members(path):
            if inner == "PKG-INFO":
                metadata = email.parser.BytesParser().parsebytes(data)
            elif inner.endswith(".py") and not excluded(inner):
                text = _text(data)
                if text is None:
                    skipped.append(inner)
                else:
                    files[inner] = data if not data or data.endswith(b"\n") else data + b"\n"
            elif _is_licence_file(inner) and (text := _text(data)) is not None:
                texts[inner] = text
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise ValueError(f"{path} is not a readable sdist ({e}); delete it (it is downloaded "
                         "again)") from e
    if metadata is None:
        raise ValueError(f"{path} has no PKG-INFO at its top level: not an sdist; correct the "
                         f"pin of {pin.label}")
    licence, source = licence_of(metadata, pin.label)
    if not is_permissive(licence):
        raise ValueError(f"{pin.label}: licence {licence!r} ({source} in its PKG-INFO) is not "
                         "permissive; the corpus takes only MIT, BSD, Apache-2.0, PSF, ISC and "
                         "the like (data.code_corpus.PERMISSIVE); remove it from the pins")
    listed = set(metadata.get_all("License-File") or [])
    folders = {f.rsplit("/", 1)[0] if "/" in f else "" for f in files}
    top = {p for p in texts if "/" not in p or p.split("/")[0].upper() in ("LICENSES", "LICENCES")}
    keep = {p for p in texts if p in listed or p in top or any(
        f == p.rsplit("/", 1)[0] or f.startswith(p.rsplit("/", 1)[0] + "/") for f in folders)}
    return Package(pin, licence, source,
                   {f"{pin.label}/{p}": files[p] for p in files},
                   {f"{pin.label}/{p}": texts[p] for p in sorted(keep) if not excluded(p)},
                   sorted(skipped))


# ---------------------------------------------------------------------------------------------
# The build.


def _stem(output: str) -> str:
    stem = output[:-3] if output.endswith(".gz") else output
    return stem[:-3] if stem.endswith(".py") else stem


def _listed(folder: str, name: str) -> str | None:
    try:
        with open(os.path.join(folder, CHECKSUMS)) as f:
            for line in f:
                digest, _, listed = line.strip().partition("  ")
                if listed.lstrip("*") == name:
                    return digest.lower()
    except OSError:
        pass
    return None


def records(output: str) -> tuple[str, str, str]:
    """The records written beside the corpus `output`: its files list, its licences and its
    checksums (`X.files.txt`, `X.licenses.txt`, `X.sha256` for `X.py.gz`)."""
    stem = _stem(output)
    return stem + ".files.txt", stem + ".licenses.txt", stem + ".sha256"


def check_output(output: str) -> None:
    """Before anything is downloaded, read or written: a one-line ValueError unless the corpus
    and its records can be written where `output` says: none of them is a folder, and the
    nearest existing folder above them is a folder this user can write in (missing folders
    below it are made when the build writes)."""
    for path in (output, *records(output)):
        if os.path.isdir(path):
            raise ValueError(f"{path} is a folder; give --output the path of a .py.gz file, or "
                             "move the folder away")
    existing = os.path.dirname(os.path.abspath(output))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        what = "a folder this user can write in" if os.path.isdir(existing) else "a folder"
        raise ValueError(f"cannot write {output}: {existing} is not {what}; choose another "
                         "--output")


def write_all(contents: list[tuple[str, bytes]]) -> None:
    """Writes every (path, bytes) or none: each in full under a temporary name first (flushed
    to the disk), then renamed into place in the order given. If anything fails (a full disk at
    the last byte, a rename), the paths keep what they held before, the temporary files and
    the folders made for them go, and a one-line OSError names the path and what to do."""
    folder = os.path.dirname(os.path.abspath(contents[0][0]))
    made = []  # the folders made here, outermost first
    while not os.path.lexists(folder):
        made.insert(0, folder)
        folder = os.path.dirname(folder)
    staged, kept, placed, path = [], {}, [], contents[0][0]
    try:
        for folder in made:
            os.mkdir(folder)
        for path, data in contents:
            staged.append((path, path + part_suffix(path)))
            with open(staged[-1][1], "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for path, _ in staged:  # what a path held before, kept until every rename is done
            if os.path.lexists(path):
                kept[path] = path + ".old" + part_suffix(path + ".old")
                try:
                    os.link(path, kept[path])
                except OSError:  # a file system without hard links
                    shutil.copyfile(path, kept[path])
        for path, tmp in staged:
            os.replace(tmp, path)
            placed.append(path)
    except OSError as e:
        for done in reversed(placed):  # back to what each held, or to nothing
            with contextlib.suppress(OSError):
                if done in kept:
                    os.replace(kept.pop(done), done)
                else:
                    os.remove(done)
        for leftover in [tmp for _, tmp in staged] + list(kept.values()):
            with contextlib.suppress(OSError):
                os.remove(leftover)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise write_error(path, e, "nothing was written; free some space (or choose another "
                                   "--output) and run it again") from e
    for old in kept.values():
        with contextlib.suppress(OSError):
            os.remove(old)


def build(pins_path: str = PINS, sdists: str = SDISTS, output: str = OUTPUT,
          download: bool = True, index_url: str = INDEX_URL) -> dict:
    """Builds `output` (a `.py.gz` file) and its `.files.txt`, `.licenses.txt` and `.sha256`
    beside it from the sdists pinned in `pins_path`; returns the facts of the build (sizes,
    checksums, per package: licence, files, bytes, skipped files)."""
    if not output.endswith(".gz"):
        raise ValueError(f"output {output} must end in .gz (the corpus is written gzip -9'd)")
    check_output(output)  # before anything is downloaded, read or written
    pins = read_pins(pins_path)
    paths = fetch(pins, sdists, pins_path, download, index_url)
    packages = [read_sdist(pin, paths[pin.label]) for pin in pins]
    files = sorted((path, package.licence) for package in packages for path in package.files)
    contents = {path: data for package in packages for path, data in package.files.items()}
    raw = b"".join(HEADER.format(path=path).encode() + contents[path] for path, _ in files)
    raw_sha = hashlib.sha256(raw).hexdigest()
    folder, raw_name = os.path.dirname(output) or ".", os.path.basename(output)[:-3]
    expected = _listed(folder, raw_name)
    if expected is not None and expected != raw_sha:
        raise ValueError(f"the build's bytes have sha256 {raw_sha[:12]}..., "
                         f"{os.path.join(folder, CHECKSUMS)} expects {expected[:12]}... for "
                         f"{raw_name}: the pins or the build changed; if that is meant, replace "
                         f"that line with '{raw_sha}  {raw_name}'")
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buffer, mtime=0) as g:
        g.write(raw)
    gz = buffer.getvalue()
    gz_sha = hashlib.sha256(gz).hexdigest()
    files_txt, licenses_txt, sha256_txt = records(output)
    licences = [f"Licences of {os.path.basename(output)}: for each package, the licence its "
                "sdist's PKG-INFO states and the licence files the sdist ships with its code.\n"]
    for package in packages:
        pin = package.pin
        size = sum(len(d) for d in package.files.values())
        licences.append(f"\n==== {pin.label}: {package.licence} ({package.licence_source}) ====\n"
                        f"sdist {pin.filename}, sha256 {pin.sha256}; {len(package.files):,} "
                        f"files, {size:,} bytes in the corpus\n")
        licences += [f"\n---- {path} ----\n{text.rstrip()}\n"
                     for path, text in package.licence_texts.items()]
    write_all([  # the corpus first, then its records
        (output, gz),
        (files_txt, "".join(f"{path}\t{licence}\n" for path, licence in files).encode()),
        (licenses_txt, "".join(licences).encode()),
        (sha256_txt, f"{gz_sha}  {os.path.basename(output)}\n{raw_sha}  {raw_name}\n".encode())])
    return {"output": output, "files": len(files), "bytes": len(raw), "sha256": raw_sha,
            "gz_bytes": len(gz), "gz_sha256": gz_sha,
            "beside": [files_txt, licenses_txt, sha256_txt],
            "packages": [{"package": p.pin.label, "licence": p.licence,
                          "licence_source": p.licence_source, "files": len(p.files),
                          "bytes": sum(len(d) for d in p.files.values()),
                          "skipped": p.skipped} for p in packages]}
