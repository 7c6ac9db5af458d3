"""Moving a prepared data dir to a machine without registry access, in size-limited transfers.

`pack(DIR, SHARDS)` compresses the dir's files into independent .xz pieces grouped into shards of at most
`shard_mib` MiB, listed with their sha256 in pack.json (interrupted, it resumes); `unpack(SHARDS, OUT)`
applies the shards that have arrived, in any order and over several calls, checks every file's sha256 once
all are there and opens the result with `TokenData`. Only lzma and numpy are needed on either side. The
format: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import lzma
import os
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from lowprec.data.prepare import sigterm_raises
from lowprec.data.tokenizers import sha256_file
from lowprec.data.tokens import TokenData
from lowprec.fsutil import atomic_write, check_target

PACK_FORMAT = "lowprec-pack/1"
SHARD_MIB = 40  # a device call carries 64 MiB with the working tree (~22 MiB here): one shard a call
PRESET = 6
PIECE = 1 << 20  # raw bytes fed to the compressor at a time
MARGIN = 1 << 20  # room left in a shard for what the compressor still holds (LZMA2 chunks are <= 64 KiB)
STATE = ".unpack.json"


def filters(preset: int) -> list[dict]:
    return [{"id": lzma.FILTER_LZMA2, "preset": preset, "lc": 0, "lp": 1, "pb": 1}]


class Stream:
    """The files of a data dir read as one byte stream, from any offset."""

    def __init__(self, folder: Path, files: list[dict]):
        self.folder, self.files = Path(folder), files
        self.size = sum(f["bytes"] for f in files)

    def read(self, offset: int, n: int) -> bytes:
        out, start = [], 0
        for f in self.files:
            end = start + f["bytes"]
            if start <= offset < end and n > 0:
                with open(self.folder / f["name"], "rb") as handle:
                    handle.seek(offset - start)
                    data = handle.read(min(n, end - offset))
                if not data:
                    raise OSError(f"{self.folder / f['name']} is shorter than when the pack began")
                out.append(data)
                offset += len(data)
                n -= len(data)
            start = end
        return b"".join(out)


def compress_span(stream: Stream, offset: int, end: int, limit: int, preset: int,
                  report: Callable[[int], None] | None = None) -> tuple[bytes, int, str]:
    """One piece: raw bytes from `offset` (up to `end`) fed to an xz compressor until its output nears
    `limit` bytes (should the last output overshoot, the piece is made again from less raw data). Returns
    (compressed bytes, raw length, sha256 of the raw bytes); `report(raw bytes so far)` now and then."""
    margin = min(MARGIN, limit // 4)
    while True:
        compressor = lzma.LZMACompressor(format=lzma.FORMAT_XZ, filters=filters(preset))
        out, written, length, digest = [], 0, 0, hashlib.sha256()
        while offset + length < end and written < limit - margin:
            piece = stream.read(offset + length, min(PIECE, end - offset - length))
            digest.update(piece)
            length += len(piece)
            data = compressor.compress(piece)
            out.append(data)
            written += len(data)
            if report is not None and length % (16 * PIECE) == 0:
                report(length)
        out.append(compressor.flush())
        blob = b"".join(out)
        if len(blob) <= limit:
            return blob, length, digest.hexdigest()
        end = offset + max(1, int(length * 0.9 * limit / len(blob)))


def pack_region(folder: str, files: list[dict], region: int, start: int, end: int, limit: int, preset: int,
                shards: str) -> None:
    """Write region `region` ([start, end) of the stream) as pieces of at most `limit` compressed bytes,
    after those already there (resuming); `.progress-R` tells how far the piece under way has come."""
    stream, shards = Stream(Path(folder), files), Path(shards)
    seq, offset = 0, start
    while (shards / f"{piece_name(region, seq)}.json").is_file():
        info = json.loads((shards / f"{piece_name(region, seq)}.json").read_text())
        offset = info["offset"] + info["raw_bytes"]
        seq += 1
    progress = shards / f".progress-{region}"
    while offset < end:
        done = offset - start
        progress.write_text(str(done))
        blob, length, raw_sha = compress_span(stream, offset, end, limit, preset,
                                              lambda n, done=done: progress.write_text(str(done + n)))
        name = piece_name(region, seq)
        info = {"file": name, "offset": offset, "raw_bytes": length, "raw_sha256": raw_sha,
                "bytes": len(blob)}
        with atomic_write(shards / name, "wb") as handle:
            handle.write(blob)
        with atomic_write(shards / f"{name}.json") as handle:  # the piece counts once this is in
            handle.write(json.dumps(info) + "\n")
        offset += length
        seq += 1
    progress.write_text(str(end - start))


def piece_name(region: int, seq: int) -> str:
    return f"part-{region}-{seq:04d}.xz"


def written_pieces(shards: Path) -> list[dict]:
    """The pieces whose .json is in place and whose file has its recorded size, in stream order."""
    found = []
    for side in sorted(shards.glob("part-*.xz.json")):
        try:
            info = json.loads(side.read_text())
        except json.JSONDecodeError:
            continue
        path = shards / info["file"]
        if path.is_file() and path.stat().st_size == info["bytes"]:
            found.append(info)
    return sorted(found, key=lambda s: s["offset"])


def bins(pieces: list[dict], limit: int) -> list[list[dict]]:
    """The pieces grouped into shards of at most `limit` bytes (first fit, largest first: each region's
    last, part-filled piece joins another), each group in stream order, the groups by their first byte."""
    groups: list[list[dict]] = []
    for piece in sorted(pieces, key=lambda p: (-p["bytes"], p["offset"])):
        home = next((g for g in groups if sum(p["bytes"] for p in g) + piece["bytes"] <= limit), None)
        if home is None:
            groups.append([piece])
        else:
            home.append(piece)
    return sorted((sorted(g, key=lambda p: p["offset"]) for g in groups), key=lambda g: g[0]["offset"])


def pack(folder: str | Path, shards: str | Path, shard_mib: float = SHARD_MIB, preset: int = PRESET,
         workers: int | None = None, progress: bool = True) -> dict:
    """Pack the data dir `folder` into `shards` (see the module's doc); returns pack.json's content.
    Re-running resumes an interrupted pack and does nothing when the pack is complete and current; shards
    of another pack in the folder are an error (choose an empty folder)."""
    data = TokenData(folder)
    if not 0.01 <= shard_mib <= 4096:
        raise ValueError(f"shard size {shard_mib} MiB: expected 0.01 to 4096 MiB")
    if not 0 <= preset <= 9:
        raise ValueError(f"preset {preset}: expected an xz preset 0-9")
    shards = check_target(shards, "shard folder")
    folder = data.path
    names = ["manifest.json", *(info["file"] for info in data.manifest["splits"].values()),
             *sorted(data.manifest["tokenizer"].get("files", {}))]
    files = [{"name": n, "bytes": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)}
             for n in names]
    size = sum(f["bytes"] for f in files)
    workers = max(1, min(workers or os.cpu_count() or 1, 8, -(-size // (64 << 20))))
    limit = int(shard_mib * 2**20)
    head = {"format": PACK_FORMAT, "spec": data.spec, "files": files, "bytes": size, "shard_bytes": limit,
            "preset": preset, "regions": workers}
    shards.mkdir(parents=True, exist_ok=True)
    index = shards / "pack.json"
    begun = shards / ".pack-begun.json"  # the head of a pack under way: its pieces may be resumed
    ours = [*shards.glob("shard-*"), *shards.glob("part-*")]
    for path in (index, begun):
        if path.is_file():
            old = json.loads(path.read_text())
            same = {k: old.get(k) for k in head} == head
            if same and path == index and old.get("complete"):
                if progress:
                    print(f"{index}: up to date ({len(old['shards'])} shards)")
                return old
            if not same and ours:
                raise ValueError(f"{shards} holds the shards of another pack ({old.get('spec')}, "
                                 f"{old.get('shard_bytes', 0) / 2**20:g} MiB shards): choose an empty folder")
    if not begun.is_file():
        if ours:
            raise ValueError(f"{shards} holds shards of an unknown pack: choose an empty folder")
        with atomic_write(begun) as handle:
            handle.write(json.dumps(head) + "\n")
    index.unlink(missing_ok=True)
    bounds = [size * r // workers for r in range(workers + 1)]
    started = time.time()
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"pack ({workers} workers)", disable=not progress)
    regions = [(str(folder), files, r, bounds[r], bounds[r + 1], limit, preset, str(shards))
               for r in range(workers)]

    def done_bytes() -> int:
        total = 0
        for r in range(workers):
            with contextlib.suppress(OSError, ValueError):  # not there yet, or being written
                total += int((shards / f".progress-{r}").read_text() or 0)
        return total

    with bar, sigterm_raises():
        if workers == 1:
            pack_region(*regions[0])
        else:
            with concurrent.futures.ProcessPoolExecutor(workers) as pool:
                jobs = [pool.submit(pack_region, *region) for region in regions]
                while not all(job.done() for job in jobs):
                    if done_bytes() > bar.n:
                        bar.update(done_bytes() - bar.n)
                    concurrent.futures.wait(jobs, timeout=1)
                for job in jobs:
                    job.result()  # a worker's error is raised here
        bar.update(size - bar.n)
        pieces = written_pieces(shards)
        covered = sum(p["raw_bytes"] for p in pieces)
        if covered != size:
            raise RuntimeError(f"the pieces in {shards} cover {covered} of {size} bytes; re-run the pack")
        done = []
        for i, group in enumerate(bins(pieces, limit)):
            blob = b"".join((shards / p["file"]).read_bytes() for p in group)
            name = f"shard-{i:03d}.xz"
            with atomic_write(shards / name, "wb") as handle:
                handle.write(blob)
            segments = [{k: p[k] for k in ("offset", "raw_bytes", "raw_sha256", "bytes")} for p in group]
            done.append({"index": i, "file": name, "bytes": len(blob),
                         "sha256": hashlib.sha256(blob).hexdigest(), "segments": segments})
        body = {**head, "complete": True, "compressed_bytes": sum(s["bytes"] for s in done), "shards": done}
        with atomic_write(index) as handle:
            handle.write(json.dumps(body, indent=1) + "\n")
        for path in [*shards.glob("part-*"), *shards.glob(".progress-*"), begun]:
            path.unlink()
    if progress:
        print(f"{len(done)} shards, {body['compressed_bytes'] / 2**20:.1f} MiB for {size / 2**20:.1f} MiB "
              f"(ratio {body['compressed_bytes'] / size:.3f}) in {time.time() - started:.0f} s")
    return body


# ---- unpack ----

def unpack(shards: str | Path, out: str | Path, progress: bool = True) -> dict:
    """Apply the shards of `shards` that have arrived to the data dir `out` (see the module's doc). Returns
    {"applied": [...], "missing": [...], "complete": bool, "path": out}."""
    shards, out = Path(shards), check_target(out, "--out")
    index = shards / "pack.json"
    if not index.is_file():
        raise FileNotFoundError(f"{index} is missing: carry it with the shards (it is written by "
                                "`lowprec data pack`)")
    try:
        head = json.loads(index.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{index} is corrupt ({exc}): carry it again") from None
    if head.get("format") != PACK_FORMAT or not head.get("complete"):
        raise ValueError(f"{index} is not a complete {PACK_FORMAT} pack: re-run `lowprec data pack`")
    files = head["files"]
    manifest = next(f for f in files if f["name"] == "manifest.json")
    if (out / "manifest.json").is_file() and sha256_file(out / "manifest.json") == manifest["sha256"]:
        data = TokenData(out)  # verifies the token files too
        if progress:
            print(f"{out}: complete already ({data!r})")
        return {"applied": [], "missing": [], "complete": True, "path": out}
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state.get("pack") != _pack_id(head):
        state = {"pack": _pack_id(head), "applied": []}
    applied = set(state["applied"])
    starts, at = {}, 0
    for f in files:
        starts[f["name"]] = at
        at += f["bytes"]
    parts = {f["name"]: out / f".{f['name']}.unpack" for f in files}
    for f in files:  # the temporary files, at their full size, to be filled in any order
        with open(parts[f["name"]], "ab") as handle:
            handle.truncate(f["bytes"])
    new, missing = [], []
    todo = [s for s in head["shards"] if s["file"] not in applied]
    with sigterm_raises():
        for s in tqdm(todo, desc="unpack", unit="shard", disable=not progress or not todo):
            path = shards / s["file"]
            if not path.is_file():
                missing.append(s["file"])
                continue
            blob = path.read_bytes()
            if len(blob) != s["bytes"] or hashlib.sha256(blob).hexdigest() != s["sha256"]:
                raise ValueError(f"{path} is damaged ({len(blob)} bytes, sha256 differs from pack.json): "
                                 "carry it again and re-run")
            at = 0
            for segment in s["segments"]:  # each an xz stream of its own
                raw = lzma.decompress(blob[at:at + segment["bytes"]], format=lzma.FORMAT_XZ)
                at += segment["bytes"]
                if (len(raw), hashlib.sha256(raw).hexdigest()) != (segment["raw_bytes"],
                                                                   segment["raw_sha256"]):
                    raise ValueError(f"{path} decompresses to other bytes than were packed: re-run the pack")
                _write_span(files, starts, parts, segment["offset"], raw)
            applied.add(s["file"])
            new.append(s["file"])
            with atomic_write(state_path) as handle:  # after the data is on disk (fsynced in _write_span)
                handle.write(json.dumps({"pack": _pack_id(head), "applied": sorted(applied)}) + "\n")
    if missing:
        if progress:
            print(f"{out}: {len(applied)} of {len(head['shards'])} shards in; still to send: "
                  f"{', '.join(missing)}")
        return {"applied": new, "missing": missing, "complete": False, "path": out}
    for f in files:
        if sha256_file(parts[f["name"]]) != f["sha256"]:
            state_path.unlink(missing_ok=True)
            raise ValueError(f"{out / f['name']}: the unpacked bytes do not match pack.json's sha256; its "
                             "shards were reset, re-run the unpack")
    (out / "manifest.json").unlink(missing_ok=True)  # until the new one is in, the dir reads incomplete
    for f in sorted(files, key=lambda f: f["name"] == "manifest.json"):  # the manifest last
        os.replace(parts[f["name"]], out / f["name"])
    state_path.unlink(missing_ok=True)
    data = TokenData(out)
    if progress:
        print(f"{out}: complete ({data!r})")
    return {"applied": new, "missing": [], "complete": True, "path": out}


def _pack_id(head: dict) -> str:
    return hashlib.sha256(json.dumps([head["files"], head["shards"]], sort_keys=True).encode()).hexdigest()


def _write_span(files: list[dict], starts: dict, parts: dict, offset: int, raw: bytes) -> None:
    """Write stream bytes [offset, offset + len(raw)) into the temporary files they belong to."""
    end = offset + len(raw)
    for f in files:
        a, b = starts[f["name"]], starts[f["name"]] + f["bytes"]
        lo, hi = max(a, offset), min(b, end)
        if lo < hi:
            with open(parts[f["name"]], "r+b") as handle:
                handle.seek(lo - a)
                handle.write(raw[lo - offset:hi - offset])
                handle.flush()
                os.fsync(handle.fileno())
