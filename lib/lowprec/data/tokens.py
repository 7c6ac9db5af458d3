"""Where token data lives (`data_root`, `default_data_dir`) and `TokenData`, which opens a prepared data dir
(train.bin, val.bin, manifest.json; see prepare.py) and checks it."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from lowprec.data.sources import resolve_sources, set_name
from lowprec.data.tokenizers import check_tokenizer_name, get_tokenizer, sha256_file

FORMAT = "lowprec-tokens/1"
SPLITS = ("train", "val")


class MissingData(FileNotFoundError):
    """No prepared data dir (or an incomplete one) where a run looks: the message names the command that makes
    it. In a notebook it shows as that one line, not a traceback through the trainer."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def data_root() -> Path:
    """`$LOWPREC_DATA`, else `<repo>/data` (git-ignored) in a source checkout."""
    if os.environ.get("LOWPREC_DATA"):
        return Path(os.environ["LOWPREC_DATA"])
    repo = Path(__file__).resolve().parents[3]
    if (repo / "pyproject.toml").is_file():
        return repo / "data"
    raise MissingData("no data directory: set LOWPREC_DATA to a folder for token data (or pass a dir)")


def default_data_dir(tokenizer: str = "gpt2", sources: str | Iterable[str] | None = None) -> Path:
    """`<data root>/<tokenizer>-<source set>`, e.g. data/gpt2-permissive."""
    check_tokenizer_name(tokenizer)
    return data_root() / f"{tokenizer}-{set_name(resolve_sources(sources))}"


def split_spec(spec: str | Path | None) -> tuple[Path | None, list[str] | None]:
    """"DIR#english,code" -> (DIR, ["english", "code"]); "#code" names the default dir; no "#": all slices."""
    if spec is None or isinstance(spec, Path) or "#" not in spec:
        return (Path(spec) if spec is not None and str(spec) != "" else None), None
    folder, _, names = spec.rpartition("#")
    return (Path(folder) if folder else None), [n.strip() for n in re.split(r"[,+]", names) if n.strip()]


class TokenData:
    """A prepared data dir: `train` and `val` as read-only uint16 memmaps, `vocab_size`, `eot`, `manifest`.
    Opening checks the manifest, the file sizes and (with `verify`) the sha256 of each .bin.

    A data dir holds one or more slices ("english", "code"), each a contiguous range of both files; `slices`
    (or a "DIR#english" spec) chooses the mix a run trains on (default: all). `mix` names it, `spec` is the
    string that opens the same data again, and `repetition(tokens_seen)` how often a run sees each token."""

    def __init__(self, path: str | Path | None = None, verify: bool = True,
                 slices: str | Iterable[str] | None = None):
        path, named = split_spec(path)
        if slices is not None:
            named = [n.strip() for n in re.split(r"[,+]", slices)] if isinstance(slices, str) else [*slices]
        self.path = path if path is not None else default_data_dir()
        remake = f"`lowprec data prepare --out {self.path}` (with the --sources/--tokenizer you want)"
        if not self.path.is_dir():
            raise MissingData(f"no prepared token data at {self.path}: create it with {remake}")
        manifest_path = self.path / "manifest.json"
        if not manifest_path.is_file():
            raise MissingData(f"{self.path} is incomplete (no manifest.json; an interrupted prepare?): "
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
            self.files = {split: self._open(split, verify, remake) for split in SPLITS}
            self.vocab_size = self.manifest["tokenizer"]["vocab_size"]
            self.eot = self.manifest["tokenizer"]["eot"]
            self.tokenizer_name = self.manifest["tokenizer"]["name"]
            self.slice_info = self.manifest.get("slices") or {  # a manifest without slices: one English slice
                "english": {"sources": [r["name"] for r in self.manifest.get("sources", [])],
                            **{s: {"offset": 0, "tokens": self.manifest["splits"][s]["tokens"],
                                   "documents": self.manifest["splits"][s]["documents"]} for s in SPLITS}}}
            self.mix = self._choose(named)
            self.splits = {split: self._range(split) for split in SPLITS}
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{manifest_path} is incomplete ({type(exc).__name__}: {exc}): re-create it "
                             f"with {remake} --force") from None
        self.train, self.val = self.splits["train"], self.splits["val"]

    def _open(self, split: str, verify: bool, remake: str) -> np.ndarray:
        info = self.manifest["splits"][split]
        path = self.path / info["file"]
        if not path.is_file():
            raise MissingData(f"{path} is missing: re-create the data with {remake} --force")
        if path.stat().st_size != 2 * info["tokens"]:
            raise ValueError(f"{path} is truncated or wrong: {path.stat().st_size} bytes, manifest says "
                             f"{info['tokens']} uint16 tokens; re-create it with {remake} --force")
        if verify and sha256_file(path) != info["sha256"]:
            raise ValueError(f"{path} does not match its sha256 in the manifest (corrupt or replaced); "
                             f"re-create it with {remake} --force")
        if info["tokens"] == 0:
            return np.zeros(0, dtype=np.uint16)
        return np.memmap(path, dtype=np.uint16, mode="r")

    def _choose(self, named: list[str] | None) -> tuple[str, ...]:
        have = list(self.slice_info)
        if named is None:
            return tuple(have)
        unknown = [n for n in named if n not in have]
        if unknown or not named:
            raise ValueError(f"{self.path}: no slice {', '.join(map(repr, unknown)) or '(empty)'}; it holds "
                             f"{', '.join(have)} (open e.g. '{self.path}#{have[0]}')")
        index = sorted({have.index(n) for n in named})
        if index != list(range(index[0], index[-1] + 1)):
            raise ValueError(f"{self.path}: slices {', '.join(named)} are not next to each other in the "
                             f"token files ({', '.join(have)}); choose adjacent ones")
        return tuple(have[i] for i in index)

    def _range(self, split: str) -> np.ndarray:
        first, last = self.slice_info[self.mix[0]][split], self.slice_info[self.mix[-1]][split]
        return self.files[split][first["offset"]:last["offset"] + last["tokens"]]

    @property
    def spec(self) -> str:
        """The string that opens this data again (with its mix): DIR, or DIR#slice,slice."""
        return str(self.path) if self.mix == tuple(self.slice_info) else f"{self.path}#{','.join(self.mix)}"

    def repetition(self, tokens_seen: int) -> float:
        """How many times a run that has seen `tokens_seen` training tokens has seen its corpus: tokens seen
        divided by the training tokens of the chosen slices (1.0 = one epoch; windows are drawn at random, so
        this is the mean number of times each token was seen)."""
        return tokens_seen / max(len(self.train), 1)

    def describe(self) -> dict:
        """What a run record should say about its data."""
        return {"spec": self.spec, "slices": list(self.mix), "train_tokens": len(self.train),
                "val_tokens": len(self.val), "tokenizer": self.tokenizer_name,
                "train_sha256": self.manifest["splits"]["train"]["sha256"],
                "terms": self.manifest.get("terms")}

    def tokenizer(self):
        """The tokenizer these tokens were made with (GPT-2 files are read from this dir if present)."""
        return get_tokenizer(self.tokenizer_name, self.path)

    def __repr__(self) -> str:
        return (f"TokenData({self.spec!r}: {self.tokenizer_name}, train {len(self.train):,d} / "
                f"val {len(self.val):,d} tokens)")
