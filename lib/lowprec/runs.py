"""Run records: one folder per training run, written incrementally, checking itself, read without torch.

`RunWriter` writes config.json, metrics.jsonl, events.jsonl and summary.json under an OS lock on the folder
(`RunLock`), with the sha256 values that let a resume (`record_matches`) and a reader find lost, repeated or
changed rows; `load_run` reads and checks a folder into a `Run` (metrics.jsonl may be gzip-compressed),
`list_runs` finds them; `provenance` says where a result came from. This module must not import torch (the
book loads records fast). The files and every key: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import gzip
import hashlib
import importlib.metadata
import io
import json
import math
import os
import pickle
import platform
import subprocess
import sys
import tarfile
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lowprec.fsutil import atomic_write, check_target, folder_locked, lock_folder

SIGNIFICANT = 5
STATUSES = ("running", "finished", "diverged", "interrupted", "failed")
METRIC_KEYS = ("step", "tokens", "loss", "lr", "grad_norm", "time_s")
EVENT_KEYS = ("event", "step")
FILES = ("config.json", "metrics.jsonl", "events.jsonl", "summary.json")
LOCK = "writer.lock"
REPO = Path(__file__).resolve().parents[2]
LIBRARY = "lib/lowprec"  # the package's folder in REPO: its Python sources are a record's code
PACKAGE = REPO / LIBRARY  # that folder here
RUN_CACHE = "LOWPREC_RUN_CACHE"  # a folder where loaded runs are kept for other processes (unset: none)


class RunRecordError(ValueError):
    """A run folder is missing a file, or a file is corrupt or truncated (the message names file and line)."""


class RunLockedError(ValueError):
    """Another live process writes the run folder (the message names it)."""


def _git_output(repo: Path, *args: str, timeout: float = 10) -> bytes | None:
    """What `git -C repo args` printed (None: git is missing, failed or took over `timeout` seconds)."""
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _git(*args: str) -> str | None:
    out = _git_output(REPO, *args)
    return None if out is None else out.decode().strip()


def library_files(root: Path = PACKAGE) -> dict[str, bytes]:
    """The library's Python sources on disk (path under the package's folder `root` -> bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.py")
            if "__pycache__" not in p.parts}


def library_files_at(commit: str, repo: Path = REPO) -> dict[str, bytes] | None:
    """The library's Python sources as `commit` holds them (None: git does not know the commit)."""
    archive = _git_output(repo, "archive", "--format=tar", commit, "--", LIBRARY, timeout=30)
    if archive is None:
        return None
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {member.name.removeprefix(f"{LIBRARY}/"): tar.extractfile(member).read() for member in tar
                if member.isfile() and member.name.endswith(".py")}


def library_sha256(files: dict[str, bytes]) -> str:
    """sha256 of the library's Python sources (`library_files`, `library_files_at`): paths and bytes."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{len(files[name])}\0".encode() + files[name])
    return digest.hexdigest()


def code_matches(prov: dict, repo: Path = REPO) -> bool | None:
    """Whether a record's library (its provenance's `library_sha256`) is the one its `git_commit` holds; None
    where it cannot say (a record without the digest, one made with uncommitted changes, a commit unknown)."""
    if not prov.get("library_sha256") or prov.get("git_dirty") or not prov.get("git_commit"):
        return None
    files = library_files_at(prov["git_commit"], repo)
    return None if files is None else library_sha256(files) == prov["library_sha256"]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor ("GenuineIntel", "AuthenticAMD", ...; /proc/cpuinfo's vendor_id where there is one):
    MKL takes other code paths on another vendor's CPU of the same instruction set."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def provenance(command: list[str] | None = None) -> dict:
    """Where a result came from: git commit and dirty flag (tracked files), versions, device, command, time.

    LOWPREC_GIT_COMMIT (and LOWPREC_GIT_DIRTY), when set by whoever launched the run, take precedence over
    what git says: a copy of the tree on the GPU machine may carry no history, or stale history.

    torch's CUDA version, the CPU kernels it picked (e.g. "AVX512": CPU results differ between them) and the
    device name are filled in only when torch is already imported (this module never imports it). `command`
    defaults to sys.argv.
    """
    if os.environ.get("LOWPREC_GIT_COMMIT"):
        commit = os.environ["LOWPREC_GIT_COMMIT"]
        dirty = os.environ.get("LOWPREC_GIT_DIRTY", "").lower() in ("1", "true", "yes")
    else:
        status = _git("status", "--porcelain", "--untracked-files=no")
        commit = _git("rev-parse", "HEAD")
        dirty = None if status is None or commit is None else bool(status)
    prov = {
        "git_commit": commit,
        "git_dirty": dirty,
        "library_sha256": library_sha256(library_files()),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "cuda": None,
        "device": platform.processor() or platform.machine(),
        "host": platform.node(),
        "command": list(sys.argv if command is None else command),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        prov["torch"] = torch.__version__
        prov["cuda"] = torch.version.cuda
        prov["cpu_capability"] = torch.backends.cpu.get_cpu_capability()  # the CPU kernels torch picked
        prov["cpu_vendor"] = cpu_vendor()
        if torch.cuda.is_available():
            prov["device"] = torch.cuda.get_device_name()
            prov["device_count"] = torch.cuda.device_count()
    return prov


def round_floats(obj: Any, digits: int = SIGNIFICANT) -> Any:
    """`obj` with every float rounded to `digits` significant digits (nested dicts, lists and tuples)."""
    if isinstance(obj, float):
        return obj if not math.isfinite(obj) or obj == 0 else float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [round_floats(v, digits) for v in obj]
    return obj


def write_json(path: str | Path, obj: Any, digits: int | None = SIGNIFICANT) -> None:
    """Write `obj` as indented JSON atomically (`atomic_write`), floats rounded to `digits` (None: exact)."""
    with atomic_write(path) as handle:
        handle.write(json.dumps(obj if digits is None else round_floats(obj, digits), indent=1) + "\n")


def digest(obj: Any) -> str:
    """sha256 of `obj` as canonical JSON (keys sorted, no spaces): equal for equal JSON values."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class RunLock:
    """An exclusive OS lock on the run folder itself (`fsutil.lock_folder`): deleting or replacing a file in
    it cannot defeat the lock, and the OS drops it when the process ends, however it ends, so a killed writer
    never blocks its folder. <run_dir>/writer.lock names the owner's PID. Creates the folder;
    RunLockedError naming the owner if another process holds the lock."""

    def __init__(self, run_dir: str | Path):
        self.dir = check_target(run_dir, "--out")
        self.path = self.dir / LOCK
        self._fd = lock_folder(self.dir)
        if self._fd is None:
            try:
                owner = f"process {self.path.read_text().strip()}"
            except (OSError, UnicodeDecodeError):
                owner = "another process"
            raise RunLockedError(f"{self.dir} is being written by {owner} (it holds an OS lock on the "
                                 "folder): wait for it to end, or stop it, first")
        try:
            with atomic_write(self.path) as handle:
                handle.write(f"{os.getpid()}\n")
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Drop the lock; a second call does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def run_state(run_dir: str | Path) -> str:
    """The status in <run_dir>/summary.json, where "running" stays "running" only while a live process holds
    the folder's lock and becomes "killed" otherwise (its writer died without closing the record)."""
    path = Path(run_dir)
    status = _read_json(path / "summary.json").get("status")
    return "killed" if status == "running" and not folder_locked(path) else status


def check_free(run_dir: str | Path) -> None:
    """ValueError unless a fresh run may start in `run_dir`: it holds no run, or one that failed or was killed
    before it logged any metrics. Call it holding the folder's lock (a "running" record is a dead one)."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl.gz").exists():
        check_resumable(run_dir)  # the refusal of a compressed record
    if not (run_dir / "metrics.jsonl").exists():
        return
    summary = run_dir / "summary.json"
    status = _read_json(summary).get("status") if summary.exists() else None
    status = "killed" if status == "running" else status
    empty = not (run_dir / "metrics.jsonl").read_bytes().strip()
    if not (empty and status in ("failed", "killed")):
        raise ValueError(f"run_dir {run_dir} already holds a run (status {status}): resume it (--resume), or "
                         "pass a new --out; a run killed before its first checkpoint cannot resume: remove "
                         "its folder to start it over")


def check_resumable(run_dir: str | Path) -> None:
    """RunRecordError unless `run_dir` holds every file of a record a resume can continue (not compressed)."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl.gz").exists():
        raise RunRecordError(f"{run_dir} holds a finished, compressed record (metrics.jsonl.gz): write to a "
                             "new --out folder")
    for name in FILES:
        if not (run_dir / name).exists():
            raise RunRecordError(f"cannot resume: {run_dir / name} is missing (resuming would lose the run's "
                                 "history); restore it, or start afresh in a new --out")


class RunWriter:
    """Writes one run folder, holding its `RunLock` until `close()` (a lock the caller took, or a new one).

    config.json holds the config, the run's `run_id` and its own sha256; each file's lines are hashed as they
    are appended, so that `mark()` gives what a checkpoint must find again on resume (`record_matches`), and
    the summary of a closed run seals the whole record (record_sha256, checked by `load_run`). A writer stops
    (RunRecordError) rather than write to a file another process replaced. `resume=True` continues an
    existing record (see `truncate_after`), dropping a last line of metrics.jsonl or events.jsonl that a kill
    cut off. A fresh start refuses a folder that holds a run (`check_free`)."""

    def __init__(self, run_dir: str | Path, config: dict, command: list[str] | None = None,
                 resume: bool = False, lock: RunLock | None = None):
        self.dir = Path(run_dir)
        self.lock = lock or RunLock(self.dir)
        try:
            self._open(config, command, resume)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, config: dict, command: list[str] | None, resume: bool) -> None:
        self._hashes = {name: hashlib.sha256() for name in ("metrics", "events")}
        self._rows = {"metrics": 0, "events": 0}
        if resume:
            check_resumable(self.dir)
            record = load_record(self.dir)  # everything is read and checked before any write
            self.summary: dict = _read_json(self.dir / "summary.json")
            metrics = _complete_rows(self.dir / "metrics.jsonl", METRIC_KEYS)
            events = _complete_rows(self.dir / "events.jsonl", EVENT_KEYS)
            _keep_lines(self.dir / "events.jsonl", events)  # without a last line a kill cut off
            self._count("metrics", metrics)
            self._count("events", events)
            self.run_id = record.get("run_id")
            record["config"] = config
        else:
            check_free(self.dir)
            self.run_id = uuid.uuid4().hex
            record = {"config": config, "run_id": self.run_id, "provenance": provenance(command)}
            for name in ("metrics.jsonl", "events.jsonl"):
                (self.dir / name).write_text("")
            self.summary = {}
        record["sha256"] = _own_digest(record)
        write_json(self.dir / "config.json", record, digits=None)
        self.record = record
        self.update_summary(status="running")
        self._metrics = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        self._events = open(self.dir / "events.jsonl", "a")  # noqa: SIM115

    def _count(self, name: str, rows: list[tuple[str, dict]]) -> None:
        self._hashes[name] = hashlib.sha256("".join(line for line, _ in rows).encode())
        self._rows[name] = len(rows)

    def log(self, record: dict) -> None:
        """Append one metrics object (must hold METRIC_KEYS)."""
        missing = [k for k in METRIC_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}; every record needs {list(METRIC_KEYS)}")
        self._append("metrics", self._metrics, record)

    def event(self, event: str, step: int | None, **fields: Any) -> None:
        """Append one event object {"event", "step", "time", **fields}."""
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._append("events", self._events, {"event": event, "step": step, "time": now, **fields})

    def mark(self) -> dict:
        """{"metrics" | "events": [rows written, sha256 of their lines]}: what `record_matches` checks."""
        return {name: [self._rows[name], hasher.hexdigest()] for name, hasher in self._hashes.items()}

    def update_summary(self, **fields: Any) -> None:
        """Merge `fields` into summary.json (rewritten atomically); a status other than "running" closes the
        record: it is sealed (record_sha256) after its metrics and events are made durable."""
        self.summary.update(fields)
        self.summary.pop("record_sha256", None)
        if self.summary.get("status") not in STATUSES:
            raise ValueError(f"summary status must be one of {STATUSES}, got {self.summary.get('status')!r}")
        if self.summary["status"] != "running" and hasattr(self, "_metrics"):
            self.sync()
            self.summary["record_sha256"] = _seal(self.mark()["metrics"][1], self.mark()["events"][1],
                                                  self.record, round_floats(self.summary))
        write_json(self.dir / "summary.json", self.summary)

    def sync(self) -> None:
        """Make the appended lines durable (fsync), e.g. before a checkpoint that counts them; a file another
        process replaced stops the writer (RunRecordError)."""
        for handle in (self._metrics, self._events):
            if not handle.closed:
                self._check_own(handle)
                with _naming(handle.name):
                    os.fsync(handle.fileno())

    def truncate_after(self, step: int) -> None:
        """Drop metrics with step > `step` (a resumed run recomputes them), and a last line cut off by a
        crash; events are kept."""
        self._metrics.close()
        path = self.dir / "metrics.jsonl"
        kept = [(line, row) for line, row in _complete_rows(path, METRIC_KEYS) if row["step"] <= step]
        _keep_lines(path, kept)
        self._count("metrics", kept)
        self._metrics = open(path, "a")  # noqa: SIM115

    def close(self) -> None:
        """Close the files and release the lock (also when closing fails, e.g. on a full disk)."""
        try:
            self._metrics.close()
            self._events.close()
        finally:
            self.lock.release()

    @staticmethod
    def _check_own(handle) -> None:
        """RunRecordError if the file `handle` writes is no longer the one at its path (another process
        rewrote or removed it: this writer must not go on)."""
        try:
            ours, there = os.fstat(handle.fileno()), os.stat(handle.name)
        except FileNotFoundError:
            there = None
        if there is None or (ours.st_dev, ours.st_ino) != (there.st_dev, there.st_ino):
            raise RunRecordError(f"{handle.name} was replaced or removed while this process wrote it "
                                 "(another writer?): stopping without writing more")

    def _append(self, name: str, handle, obj: dict) -> None:
        self._check_own(handle)
        line = json.dumps(round_floats(obj), separators=(",", ":")) + "\n"
        with _naming(handle.name):
            handle.write(line)
            handle.flush()
        self._hashes[name].update(line.encode())
        self._rows[name] += 1


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """An OSError in the block (a full disk) names the file it was writing."""
    try:
        yield
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror or exc}") from exc


def _own_digest(obj: dict) -> str:
    """The sha256 a JSON object holds of itself: `digest` of it without its "sha256" key."""
    return digest({k: v for k, v in obj.items() if k != "sha256"})


def _seal(metrics_sha256: str, events_sha256: str, record: dict, summary: dict) -> str:
    """record_sha256: one sha256 over the metrics' and events' bytes, config.json and the summary (without
    this key), for a closed record."""
    summary = {k: v for k, v in summary.items() if k != "record_sha256"}
    return digest([metrics_sha256, events_sha256, digest(record), digest(summary)])


def record_matches(run_dir: str | Path, step: int, mark: dict) -> str | None:
    """None if the record in `run_dir` still holds the rows a checkpoint of `step` counted (`RunWriter.mark`:
    the metrics of steps < `step` and the first events, by number and sha256; a last line cut off mid-line
    is no row), else what differs, in a few words."""
    run_dir = Path(run_dir)
    metrics = [line for line, row in _complete_rows(run_dir / "metrics.jsonl", METRIC_KEYS)
               if row["step"] < step]
    events = [line for line, _ in _complete_rows(run_dir / "events.jsonl", EVENT_KEYS)]
    for name, lines in (("metrics", metrics), ("events", events)):
        rows, sha256 = mark[name]
        if len(lines) < rows or hashlib.sha256("".join(lines[:rows]).encode()).hexdigest() != sha256:
            what = "steps before" if name == "metrics" else "events up to"
            return (f"{name}.jsonl no longer holds the {rows} rows of {what} step {step} it held then "
                    f"(it has {len(lines)}: rows lost, repeated or changed)")
        if name == "metrics" and len(lines) > rows:
            return f"metrics.jsonl holds {len(lines) - rows} more rows before step {step} than it held then"
    return None


# ---- reading ----

@dataclass
class Run:
    """A loaded run folder."""

    path: Path
    config: dict
    provenance: dict
    metrics: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    def series(self, key: str) -> tuple[list[int], list]:
        """(steps, values) of a top-level metric over the records that have it."""
        rows = [m for m in self.metrics if key in m]
        return [m["step"] for m in rows], [m[key] for m in rows]

    def telemetry(self, name: str) -> tuple[list[int], list[list[list[float]]]]:
        """(steps, values[sample][layer][head]) of one telemetry signal, e.g. "wq_norm" or "delta_error"."""
        rows = [m for m in self.metrics if name in m.get("telemetry", {})]
        return [m["step"] for m in rows], [m["telemetry"][name] for m in rows]

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise RunRecordError(f"{path} is missing")
    try:
        obj = json.loads(_read_text(path)[0])
    except json.JSONDecodeError as exc:
        raise RunRecordError(f"{path}: corrupt JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise RunRecordError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _read_text(path: Path) -> tuple[str, str]:
    """(text, sha256 of its bytes) of a record file, gunzipped if it ends in .gz; RunRecordError naming the
    file (and the line of a byte that is not UTF-8) if it cannot be read as text."""
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or "truncated"
        raise RunRecordError(f"{path}: cannot be read ({reason})") from None
    try:
        return data.decode(), hashlib.sha256(data).hexdigest()
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise RunRecordError(f"{path}:{line}: not UTF-8 text (byte {exc.start})") from None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# key -> (what it must be, check) of the rows of metrics.jsonl and events.jsonl, where present
ROW_TYPES: dict[str, tuple[str, Any]] = {
    "step": ("an int >= 0", _is_count), "tokens": ("an int >= 0", _is_count),
    "loss": ("a number", _is_number), "lr": ("a number", _is_number), "grad_norm": ("a number", _is_number),
    "time_s": ("a number", _is_number), "tokens_per_s": ("a number", _is_number),
    "val_loss": ("a number", _is_number), "telemetry_s": ("a number", _is_number),
    "telemetry": ("an object", lambda v: isinstance(v, dict)),
    "event": ("a string", lambda v: isinstance(v, str)),
}


def _parse_line(path: Path, number: int, line: str, required: tuple[str, ...], torn: bool = False) -> dict:
    """Line `number` of a .jsonl file as an object holding `required` keys, each of its type (`ROW_TYPES`;
    an event's step may be null); RunRecordError naming file and line (`torn`: the line is the last one and
    has no newline)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        what = "truncated (the writer stopped mid-line)" if torn else f"corrupt ({exc.msg})"
        raise RunRecordError(f"{path}:{number}: {what}") from None
    if not isinstance(obj, dict):
        raise RunRecordError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise RunRecordError(f"{path}:{number}: missing keys {missing}")
    for key, (what, ok) in ROW_TYPES.items():
        if key in obj and not ok(obj[key]) and not (key == "step" and "event" in obj and obj[key] is None):
            raise RunRecordError(f"{path}:{number}: {key} must be {what}, got {obj[key]!r}")
    return obj


def _read_jsonl(path: Path, required: tuple[str, ...]) -> tuple[list[dict], str]:
    """(objects, sha256 of the file's bytes) of a .jsonl record file, each line checked (`_parse_line`)."""
    if not path.exists():
        raise RunRecordError(f"{path} is missing")
    text, sha256 = _read_text(path)
    lines = text.splitlines()
    rows = [_parse_line(path, number, line, required, torn=number == len(lines) and not text.endswith("\n"))
            for number, line in enumerate(lines, start=1) if line.strip()]
    return rows, sha256


def _complete_rows(path: Path, required: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(line, object) of each line of a .jsonl file but a last one cut off mid-line (dropped)."""
    lines = _read_text(path)[0].splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    return [(line, _parse_line(path, number, line, required)) for number, line in enumerate(lines, start=1)
            if line.strip()]


def _keep_lines(path: Path, rows: list[tuple[str, dict]]) -> None:
    """Rewrite a .jsonl file (atomically) with only these (line, object) rows."""
    with atomic_write(path) as handle:
        handle.write("".join(line for line, _ in rows))


def load_record(run_dir: str | Path, keys: tuple[str, ...] = ("config",)) -> dict:
    """<run_dir>/config.json, checked: {"config": the run's config, "provenance", and in records that have
    them "run_id" and "sha256" (of the rest: a file edited by hand is refused)}; RunRecordError naming the
    file if it is missing, corrupt or edited (`keys`: the objects it must hold)."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise RunRecordError(f"{path} does not exist (is {run_dir} the folder of a run?)")
    record = _read_json(path)
    for key in keys:
        if not isinstance(record.get(key), dict):
            raise RunRecordError(f"{path}: missing key {key!r} (the run's {key}), or not an object")
    if "sha256" in record and record["sha256"] != _own_digest(record):
        raise RunRecordError(f"{path}: the file does not match its sha256 (changed since the run "
                             "wrote it); restore it: `lowprec train --resume --set KEY=VALUE` makes the "
                             "changes a resume may make, and records them")
    return record


def load_config(run_dir: str | Path) -> dict:
    """The config recorded in <run_dir>/config.json (`load_record`)."""
    return load_record(run_dir)["config"]


RUN_FILES = ("config.json", "metrics.jsonl", "metrics.jsonl.gz", "events.jsonl", "summary.json")


def metrics_file(run_dir: str | Path) -> Path:
    """A run folder's metrics: metrics.jsonl, or metrics.jsonl.gz where only that exists."""
    plain = Path(run_dir) / "metrics.jsonl"
    packed = plain.with_name("metrics.jsonl.gz")
    return packed if packed.exists() and not plain.exists() else plain


def _stamp(path: Path) -> tuple:
    """(inode, mtime in ns, size) of each of a run folder's files (None where one is missing): an append
    changes the size, a rewrite (atomic_write: a new file renamed into place) the inode."""
    def of(file: Path) -> tuple[int, int, int] | None:
        try:
            st = file.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    return tuple(of(path / name) for name in RUN_FILES)


def load_run(run_dir: str | Path) -> Run:
    """Load and validate a run folder; raises RunRecordError naming the bad file (and line). A folder whose
    files are unchanged since this process last read it gives the same Run again (treat it as read-only)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunRecordError(f"run folder {path} does not exist")
    return _read_run(path, _stamp(path))


def _check_summary(path: Path, summary: dict, metrics: list[dict]) -> None:
    """RunRecordError unless summary.json's status, steps and diverged_step fit each other and the metrics
    (a finished run logged its last step, a diverged one the step the stop rule fired at)."""
    name = path / "summary.json"
    status = summary.get("status")
    if status not in STATUSES:
        raise RunRecordError(f"{name}: status must be one of {STATUSES}, got {status!r}")
    for key in ("steps", "diverged_step"):
        if summary.get(key) is not None and not _is_count(summary[key]):
            raise RunRecordError(f"{name}: {key} must be an int >= 0, got {summary[key]!r}")
    last = metrics[-1]["step"] if metrics else None
    steps = summary.get("steps")
    expected = {"finished": None if not steps else steps - 1,
                "diverged": summary.get("diverged_step")}.get(status)
    if expected is not None and last != expected:
        raise RunRecordError(f"{name} says the run {status} at step {expected}, but the last step its "
                             f"metrics hold is {last} (metrics lost or out of place)")
    if status in ("interrupted", "failed") and steps is not None and last is not None and last >= steps:
        raise RunRecordError(f"{name} says the run {status} after {steps} steps, but its metrics hold step "
                             f"{last}")


@functools.cache
def _source_digest() -> str:
    """sha256 of this module: a kept Run is used only by the code that read it."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _kept_file(path: Path, stamp: tuple) -> Path | None:
    """Where $LOWPREC_RUN_CACHE keeps the Run of `path` as of `stamp` (None: no such folder is set)."""
    folder = os.environ.get(RUN_CACHE)
    if not folder:
        return None
    key = hashlib.sha256(repr((str(path.resolve()), stamp, _source_digest())).encode()).hexdigest()
    return Path(folder) / f"{key}.pickle"


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (then restored as it was): a run's record is built as ~10^5
    small lists and dicts, none in a reference cycle, and the collector's passes over them while they were
    built took two thirds of a load."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@functools.lru_cache(maxsize=1024)  # a process may read all ~150 committed records several times: a
# cache smaller than their number evicts each run just before it is read again
def _read_run(path: Path, stamp: tuple) -> Run:
    """The Run in `path` as of `stamp`: the one of the folder `path` resolves to, with this `path` (a folder
    read through links, as the tests' copies of `results/` do, shares its rows instead of holding another
    ~10^5 objects per run)."""
    run = _read_folder(path.resolve(), stamp)
    return run if run.path == path else replace(run, path=path)


@functools.lru_cache(maxsize=1024)
def _read_folder(path: Path, stamp: tuple) -> Run:
    """The Run in the resolved folder `path` (read afresh for each new `stamp` of its files): from
    $LOWPREC_RUN_CACHE where another process kept it (the book's pages read the same records), else parsed,
    checked and kept there."""
    with _collector_paused():
        return _kept_or_parsed(path, stamp)


def _kept_or_parsed(path: Path, stamp: tuple) -> Run:
    kept = _kept_file(path, stamp)
    if kept is not None and kept.exists():
        try:  # kept by whoever read the folder first, through any path to it: the Run takes this caller's
            return replace(pickle.loads(kept.read_bytes()), path=path)
        except Exception:  # noqa: BLE001 (a damaged or foreign file: read the record instead)
            pass
    run = _parse_run(path)
    if kept is not None:
        with contextlib.suppress(OSError):
            kept.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(kept, "wb") as handle:
                pickle.dump(run, handle, protocol=pickle.HIGHEST_PROTOCOL)
    return run


def _parse_run(path: Path) -> Run:
    """Read and check the run folder `path`."""
    record = load_record(path, ("config", "provenance"))
    metrics, metrics_sha256 = _read_jsonl(metrics_file(path), METRIC_KEYS)
    for number, (prev, cur) in enumerate(zip(metrics, metrics[1:], strict=False), start=2):
        if cur["step"] <= prev["step"]:
            raise RunRecordError(f"{metrics_file(path)}: record {number} has step {cur['step']} after "
                                 f"step {prev['step']} (steps must increase)")
    events, events_sha256 = _read_jsonl(path / "events.jsonl", EVENT_KEYS)
    summary = _read_json(path / "summary.json")
    sealed = summary.get("record_sha256")
    intact = sealed is None or sealed == _seal(metrics_sha256, events_sha256, record, round_floats(summary))
    if "explosion_step" in summary:  # the old name of diverged_step
        summary["diverged_step"] = summary.pop("explosion_step")
    _check_summary(path, summary, metrics)  # first: its message says what is wrong
    if not intact:
        raise RunRecordError(f"{path}: the record does not match the record_sha256 in summary.json (a file "
                             "changed since the run ended: metrics.jsonl, events.jsonl, config.json or "
                             "summary.json)")
    return Run(path, record["config"], record["provenance"], metrics, events, summary)


def list_runs(root: str | Path) -> list[dict]:
    """Every run folder under `root` (any depth, sorted by path) as {"path", **summary}; metrics not read."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"root {root} is not a folder")
    runs = []
    for config in sorted(root.rglob("config.json")):
        summary_path = config.parent / "summary.json"
        if metrics_file(config.parent).exists():
            summary = _read_json(summary_path) if summary_path.exists() else {}
            runs.append({"path": str(config.parent), **summary})
    return runs


def experiments(root: str | Path) -> list[Path]:
    """The experiment folders directly under `root` (sorted): each a run folder or a folder of run folders."""
    return sorted(folder for folder in Path(root).iterdir() if folder.is_dir() and any(
        (run / "config.json").exists() for run in (folder, *(d for d in folder.iterdir() if d.is_dir()))))


def load_experiment(folder: str | Path, name: Callable[[dict], str] | None = None) -> dict[str, Run]:
    """The training runs of one experiment folder (each run folder directly inside it, or the folder itself
    where it is one run), loaded, by `name(config)` (default: the folder's name); replays kept inside a run
    folder are not its runs. ValueError if two runs get one name or the folder holds no run."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"experiment folder {folder} does not exist")
    found = [folder] if (folder / "config.json").exists() else sorted(
        d for d in folder.iterdir() if (d / "config.json").exists() and not (d / "replay.json").exists())
    if not found:
        raise ValueError(f"{folder} holds no run folder")
    runs: dict[str, Run] = {}
    for path in found:
        run = load_run(path)
        key = name(run.config) if name else path.name
        if key in runs:
            raise ValueError(f"{folder}: two runs named {key!r} ({runs[key].path.name}, {path.name})")
        runs[key] = run
    return runs
