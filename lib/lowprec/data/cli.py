"""`lowprec data prepare` (fetch, extract, tokenise), `lowprec data info` (check, summarise a data dir), and
`lowprec data pack` / `lowprec data unpack` (move a data dir in size-limited shards to a machine without
registry access)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lowprec.checks import option
from lowprec.data.prepare import CODE_CAP_MIB, VAL_FRAC, prepare
from lowprec.data.sources import GROUPS, SOURCES
from lowprec.data.tokenizers import TOKENIZERS
from lowprec.data.tokens import TokenData, default_data_dir


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sources = ", ".join(f"{s.name} ({s.slice}, {s.terms})" for s in SOURCES.values())
    groups = "; ".join(f"{g} = {','.join(m)}" for g, m in GROUPS.items())
    p = sub.add_parser("prepare", help="fetch the source packages, write train.bin/val.bin + manifest.json",
                       description=f"Sources: {sources}. Groups: {groups}. The ~300M-token set of English "
                                   "and code is --sources english,code.")
    p.add_argument("--sources", default="permissive",
                   help="comma-separated sources or groups (default: permissive)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2")
    p.add_argument("--out", type=Path,
                   help="data dir (default: <$LOWPREC_DATA or <repo>/data>/<tokenizer>-<source set>)")
    p.add_argument("--raw", type=Path,
                   help="package archive cache, tokenised sources in its tokens/ (default: <data root>/raw)")
    p.add_argument("--val-frac", type=float, default=VAL_FRAC,
                   help=f"validation share of each source's tokens, whole documents (default {VAL_FRAC})")
    p.add_argument("--cap-mib", type=option(float, 0, low_open=True), default=CODE_CAP_MIB,
                   help=f"code: at most this many MiB of text per package (default {CODE_CAP_MIB})")
    p.add_argument("--force", action="store_true", help="rebuild even when the dir is up to date")
    i = sub.add_parser("info", help="check a data dir (sizes, sha256) and summarise its manifest")
    i.add_argument("dir", nargs="?", help="data dir, DIR#slice to look at one slice (default: the gpt2 "
                                          "permissive one)")
    i.add_argument("--packages", action="store_true", help="list every package of several-package sources")
    k = sub.add_parser("pack", help="write a data dir as xz shards of at most --shard-mib MiB + pack.json",
                       description="Shards for size-limited transfers to a machine without registry access; "
                                   "send pack.json with each shard, then run `lowprec data unpack` there.")
    k.add_argument("dir", type=Path, help="the data dir")
    k.add_argument("--out", type=Path, required=True, help="folder for the shards (empty, or this pack's)")
    k.add_argument("--shard-mib", type=float, default=None, help="largest shard in MiB (default 40)")
    k.add_argument("--preset", type=int, default=None, help="xz preset 0-9 (default 6)")
    k.add_argument("--workers", type=option(int, 1), default=None,
                   help="compressing processes (default: the cores)")
    u = sub.add_parser("unpack", help="apply the shards that have arrived; when all are in, a data dir",
                       description="Checks each shard against pack.json and writes it into place; re-run it "
                                   "after each transfer: shards already applied are skipped.")
    u.add_argument("shards", type=Path, help="folder holding pack.json and some or all shards")
    u.add_argument("--out", type=Path, required=True, help="the data dir to fill")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "prepare":
            out = prepare(args.sources, args.tokenizer, args.out, args.raw, args.val_frac, args.force,
                          cap_mib=args.cap_mib)
            print(summary(TokenData(out)))
        elif args.action == "info":
            print(summary(TokenData(args.dir or default_data_dir()), args.packages))
        elif args.action == "pack":
            from lowprec.data.pack import PRESET, SHARD_MIB, pack

            body = pack(args.dir, args.out, args.shard_mib or SHARD_MIB,
                        PRESET if args.preset is None else args.preset, args.workers)
            print(transfer_plan(body, args.out))
        else:
            from lowprec.data.pack import unpack

            result = unpack(args.shards, args.out)
            if not result["complete"]:
                return 0
            print(summary(TokenData(args.out)))
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    return 0


def transfer_plan(body: dict, shards: Path) -> str:
    """How to send a pack: one call per shard, each carrying pack.json and the shard."""
    lines = [f"{len(body['shards'])} shards of at most {body['shard_bytes'] / 2**20:g} MiB, "
             f"{body['compressed_bytes'] / 2**20:.1f} MiB in all (raw {body['bytes'] / 2**20:.1f} MiB); per "
             f"transfer carry {shards}/pack.json and one shard, then run "
             f"`lowprec data unpack {shards} --out DIR` there:"]
    for s in body["shards"]:
        spans = ", ".join(f"{g['offset']:,d} +{g['raw_bytes']:,d}" for g in s["segments"])
        lines.append(f"  {s['file']}  {s['bytes'] / 2**20:6.1f} MiB  (raw bytes {spans})")
    return "\n".join(lines)


def summary(data: TokenData, packages: bool = False) -> str:
    m = data.manifest
    tok = m["tokenizer"]
    lines = [f"{data.path}  ({tok['name']} vocab {tok['vocab_size']} eot {tok['eot']}) made {m['created']}"]
    for r in m["sources"]:
        several = "packages" in r and ("*" in r["package"] or len(r["packages"]) > 1)
        used, skipped = r.get("packages_used", 0), r.get("packages_skipped", 0)
        package = f"{r['package']} [{used} used, {skipped} skipped]" if several else r["package"]
        lines.append(f"  {r.get('slice', 'english'):7s} {r['name']:15s} {package:52s} "
                     f"docs {sum(r['documents'].values()):8,d}  MB {r.get('text_bytes', 0) / 1e6:7.1f}  "
                     f"train {r['tokens']['train']:12,d} val {r['tokens']['val']:10,d}  [{r['terms']}]")
        if packages and several:
            for p in r["packages"]:
                tokens = sum(p.get("tokens", {}).values())
                lines.append(f"      {p['package']}=={p['version']}  {p['licence'][:40]}  "
                             f"{p.get('skipped') or f'{tokens:,d} tokens'}")
    for name, info in data.slice_info.items():
        mark = "*" if name in data.mix else " "
        lines.append(f" {mark}slice {name:8s} train {info['train']['tokens']:13,d} tokens  val "
                     f"{info['val']['tokens']:11,d}  ({', '.join(info.get('sources', []))})")
    for split, info in m["splits"].items():
        lines.append(f"  {split}.bin  {info['tokens']:,d} tokens, {info['documents']:,d} docs, "
                     f"{2 * info['tokens'] / 2**20:.1f} MiB, sha256 {info['sha256'][:16]}...")
    lines.append(f"  mix {'+'.join(data.mix)}: train {len(data.train):,d} tokens (open it as "
                 f"'{data.spec}'); repetition = tokens seen / {len(data.train):,d}")
    lines.append(f"  notice: {m['notice']}")
    return "\n".join(lines)
