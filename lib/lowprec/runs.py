"""Run records: one folder per training run, written incrementally and read back without torch.

`RunWriter` writes config.json, metrics.jsonl, events.jsonl and summary.json under an OS lock (`RunLock`);
`load_run` reads and checks a folder into a `Run` (metrics.jsonl may be gzip-compressed), `list_runs` finds
them; `provenance` says where a result came from. This module must not import torch (the book loads records
fast). The files and every key: the book's appendix "Methods and record formats".
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import gzip
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowprec.fsutil import atomic_write, check_target

SIGNIFICANT = 5
STATUSES = ("running", "finished", "diverged", "interrupted", "failed")
METRIC_KEYS = ("step", "tokens", "loss", "lr", "grad_norm", "time_s")
EVENT_KEYS = ("event", "step")
FILES = ("config.json", "metrics.jsonl", "events.jsonl", "summary.json")
LOCK = "writer.lock"
REPO = Path(__file__).resolve().parents[2]


class RunRecordError(ValueError):
    """A run folder is missing a file, or a file is corrupt or truncated (the message names file and line)."""


class RunLockedError(ValueError):
    """Another live process writes the run folder (the message names it)."""


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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


def write_json(path: str | Path, obj: Any) -> None:
    """Write `obj` as indented JSON atomically (`atomic_write`), floats rounded."""
    with atomic_write(path) as handle:
        handle.write(json.dumps(round_floats(obj), indent=1) + "\n")


class RunLock:
    """An exclusive OS lock (fcntl.flock) on <run_dir>/writer.lock, which holds the owner's PID. The OS drops
    it when the process ends, however it ends, so a killed writer never blocks its folder. Creates the folder;
    RunLockedError naming the owner if another process holds the lock."""

    def __init__(self, run_dir: str | Path):
        self.path = check_target(run_dir, "--out") / LOCK
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+")  # noqa: SIM115 (closed in release(), or with the process)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            owner = self._file.read().strip() or "?"
            self._file.close()
            raise RunLockedError(f"{self.path.parent} is being written by process {owner} (it holds "
                                 f"{self.path}): wait for it to end, or stop it, first") from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        """Drop the lock (closing the file does); a second call does nothing."""
        self._file.close()


def _locked(run_dir: Path) -> bool:
    """Whether a live process holds <run_dir>/writer.lock."""
    try:
        handle = open(run_dir / LOCK)  # noqa: SIM115
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def run_state(run_dir: str | Path) -> str:
    """The status in <run_dir>/summary.json, where "running" stays "running" only while a live process holds
    the folder's lock and becomes "killed" otherwise (its writer died without closing the record)."""
    path = Path(run_dir)
    status = _read_json(path / "summary.json").get("status")
    return "killed" if status == "running" and not _locked(path) else status


class RunWriter:
    """Writes one run folder, holding its `RunLock` until `close()` (a lock the caller took, or a new one).
    `resume=True` continues an existing record (see `truncate_after`), dropping a last line of metrics.jsonl
    or events.jsonl that a kill cut off. A fresh start refuses a folder that holds a run, unless that run
    failed or was killed before it logged any metrics."""

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
        if (self.dir / "metrics.jsonl.gz").exists():
            raise RunRecordError(f"{self.dir} holds a finished, compressed record (metrics.jsonl.gz): "
                                 "write to a new --out folder")
        if resume:
            for name in FILES:
                if not (self.dir / name).exists():
                    raise RunRecordError(f"cannot resume: {self.dir / name} is missing (resuming would lose "
                                         "the run's history); restore it, or start afresh in a new --out")
            record = _read_json(self.dir / "config.json")  # everything is read and checked before any write
            self.summary: dict = _read_json(self.dir / "summary.json")
            _complete_rows(self.dir / "metrics.jsonl", METRIC_KEYS)
            events = _complete_rows(self.dir / "events.jsonl", EVENT_KEYS)
            _keep_lines(self.dir / "events.jsonl", events)  # without a last line a kill cut off
            record["config"] = config
            write_json(self.dir / "config.json", record)
        else:
            if (self.dir / "metrics.jsonl").exists():
                summary = self.dir / "summary.json"
                status = _read_json(summary).get("status") if summary.exists() else None
                status = "killed" if status == "running" else status  # the lock is ours: that writer died
                empty = not (self.dir / "metrics.jsonl").read_text().strip()
                if not (empty and status in ("failed", "killed")):
                    raise ValueError(f"run_dir {self.dir} already holds a run (status {status}): pass "
                                     "resume=True (--resume) or a new --out folder")
            write_json(self.dir / "config.json", {"config": config, "provenance": provenance(command)})
            for name in ("metrics.jsonl", "events.jsonl"):
                (self.dir / name).write_text("")
            self.summary = {}
        self.update_summary(status="running")
        self._metrics = open(self.dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        self._events = open(self.dir / "events.jsonl", "a")  # noqa: SIM115

    def log(self, record: dict) -> None:
        """Append one metrics object (must hold METRIC_KEYS)."""
        missing = [k for k in METRIC_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}; every record needs {list(METRIC_KEYS)}")
        self._append(self._metrics, record)

    def event(self, event: str, step: int | None, **fields: Any) -> None:
        """Append one event object {"event", "step", "time", **fields}."""
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._append(self._events, {"event": event, "step": step, "time": now, **fields})

    def update_summary(self, **fields: Any) -> None:
        """Merge `fields` into summary.json (rewritten atomically)."""
        self.summary.update(fields)
        if self.summary.get("status") not in STATUSES:
            raise ValueError(f"summary status must be one of {STATUSES}, got {self.summary.get('status')!r}")
        write_json(self.dir / "summary.json", self.summary)

    def truncate_after(self, step: int) -> None:
        """Drop metrics with step > `step` (a resumed run recomputes them), and a last line cut off by a
        crash; events are kept."""
        self._metrics.close()
        path = self.dir / "metrics.jsonl"
        _keep_lines(path, [(line, row) for line, row in _complete_rows(path, METRIC_KEYS)
                           if row["step"] <= step])
        self._metrics = open(path, "a")  # noqa: SIM115

    def close(self) -> None:
        """Close the files and release the lock (also when closing fails, e.g. on a full disk)."""
        try:
            self._metrics.close()
            self._events.close()
        finally:
            self.lock.release()

    @staticmethod
    def _append(handle, obj: dict) -> None:
        try:
            handle.write(json.dumps(round_floats(obj), separators=(",", ":")) + "\n")
            handle.flush()
        except OSError as exc:
            raise OSError(exc.errno, f"cannot append to {handle.name}: {exc.strerror or exc}") from exc


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
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunRecordError(f"{path}: corrupt JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise RunRecordError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _parse_line(path: Path, number: int, line: str, required: tuple[str, ...], torn: bool = False) -> dict:
    """Line `number` of a .jsonl file as an object holding `required` keys; RunRecordError naming file and
    line (`torn`: the line is the last one and has no newline)."""
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
    return obj


def _read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    if not path.exists():
        raise RunRecordError(f"{path} is missing")
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    lines = text.splitlines()
    return [_parse_line(path, number, line, required, torn=number == len(lines) and not text.endswith("\n"))
            for number, line in enumerate(lines, start=1) if line.strip()]


def _complete_rows(path: Path, required: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(line, object) of each line of a .jsonl file but a last one cut off mid-line (dropped)."""
    lines = path.read_text().splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    return [(line, _parse_line(path, number, line, required)) for number, line in enumerate(lines, start=1)
            if line.strip()]


def _keep_lines(path: Path, rows: list[tuple[str, dict]]) -> None:
    """Rewrite a .jsonl file (atomically) with only these (line, object) rows."""
    with atomic_write(path) as handle:
        handle.write("".join(line for line, _ in rows))


def load_config(run_dir: str | Path) -> dict:
    """The config recorded in <run_dir>/config.json; RunRecordError naming the file if it is missing or
    corrupt."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise RunRecordError(f"{path} does not exist (is {run_dir} the folder of a run?)")
    record = _read_json(path)
    if not isinstance(record.get("config"), dict):
        raise RunRecordError(f"{path}: missing key 'config' (the run's config)")
    return record["config"]


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


@functools.lru_cache(maxsize=128)  # a chapter reads each of the ~70 records several times
def _read_run(path: Path, stamp: tuple) -> Run:
    """The Run in `path` (read afresh for each new `stamp` of its files)."""
    record = _read_json(path / "config.json")
    for key in ("config", "provenance"):
        if key not in record:
            raise RunRecordError(f"{path / 'config.json'}: missing key {key!r}")
    metrics = _read_jsonl(metrics_file(path), METRIC_KEYS)
    for number, (prev, cur) in enumerate(zip(metrics, metrics[1:], strict=False), start=2):
        if cur["step"] <= prev["step"]:
            raise RunRecordError(f"{metrics_file(path)}: record {number} has step {cur['step']} after "
                                 f"step {prev['step']} (steps must increase)")
    events = _read_jsonl(path / "events.jsonl", EVENT_KEYS)
    summary = _read_json(path / "summary.json")
    if "explosion_step" in summary:  # the old name of diverged_step
        summary["diverged_step"] = summary.pop("explosion_step")
    if summary.get("status") not in STATUSES:
        raise RunRecordError(f"{path / 'summary.json'}: status must be one of {STATUSES}, "
                             f"got {summary.get('status')!r}")
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
