"""lowprec.data: text and code from registry packages -> GPT-2 BPE or byte tokens -> deterministic batches.

`prepare` (`lowprec data prepare`) writes a data dir (train.bin, val.bin, manifest.json) that `TokenData`
opens; `pack` / `unpack` move one in verified shards; `sample_data` makes a tiny one from the committed
sample; `get_tokenizer` gives "gpt2" or "bytes"; `sample_batch(tokens, seed, step, ...)` is a step's (x, y)
batch, a pure function of (seed, step), and `batch_indices` its window starts.
"""

from lowprec.data.pack import pack, unpack
from lowprec.data.prepare import prepare, sample_data
from lowprec.data.sampler import batch_from_indices, batch_indices, sample_batch
from lowprec.data.sources import DEFAULT_SOURCES, GROUPS, SLICES, SOURCES, resolve_sources
from lowprec.data.tokenizers import EOT_TEXT, TOKENIZERS, get_tokenizer
from lowprec.data.tokens import MissingData, TokenData, data_root, default_data_dir

__all__ = [
    "DEFAULT_SOURCES", "EOT_TEXT", "GROUPS", "MissingData", "SLICES", "SOURCES", "TOKENIZERS", "TokenData",
    "batch_from_indices", "batch_indices", "data_root", "default_data_dir", "get_tokenizer", "pack",
    "prepare", "resolve_sources", "sample_batch", "sample_data", "unpack",
]
