"""Chapter kernels forked from a warm interpreter instead of started from scratch (`make book`).

A kernel that starts from scratch spends about 3 s of CPU before a chapter's first line does anything: the
kernel's own imports (ipykernel, IPython) and then the imports every chapter begins with (`from lowprec import
viz`: torch, plotly). `Zygote` is one process that imports those once, reads the committed run records
(a kernel's `load_run` of an unchanged folder then gives the Run read there; nothing else: no chapter code, no
kernel, one thread) and forks a kernel for each chapter; `ZygoteKernelManager` is the kernel manager
(nbclient's `kernel_manager_class`) that asks it for one where the kernelspec would run
`python -m ipykernel_launcher`, and launches as usual otherwise. The forked kernel is the kernel the
kernelspec starts: the same interpreter, argv (its connection file), working directory and environment, its
own session (signals reach its process group, as for a launched kernel), torch's default generator seeded
afresh as a new process seeds it (Python's random reseeds itself in a fork), and at its end the exit handlers
run but not the interpreter's teardown (0.6 s with torch loaded: nothing the chapter sees). It dies with the
zygote, which ends when the process that started it closes its pipe. _ext/execute_chapters.py uses it (about
4 s of CPU less per chapter); a chapter that fails there runs again in the build's own kernel.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

from jupyter_client.manager import AsyncKernelManager

# what the zygote imports before it forks: the kernel's modules, the first import of every chapter and the
# bottom line's (the pages' most common import: with it the model and attention)
PRELOAD = ("ipykernel.kernelapp", "lowprec.viz", "lowprec.viz.bottom_line")
# the run records it reads before it forks (most chapters read most of them: each kernel would spend ~3 s of
# CPU parsing or unpickling them, and its collector's passes over their ~10^7 objects, where the zygote's
# copy is read once and frozen out of the collector's sight)
RECORDS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")

# requests (JSON lines) on stdin, answers (a line each) on the file descriptor argv[1]; stdout and stderr are
# the starter's, as a launched kernel's are
ZYGOTE = r"""
import ctypes, gc, importlib, json, os, signal, sys
from pathlib import Path
answers = os.fdopen(int(sys.argv[1]), "w")
for name in sys.argv[3:]:
    importlib.import_module(name)
if sys.argv[2]:  # a kernel's load_run of a folder whose files are unchanged gives the Run read here
    from lowprec import runs
    for config in sorted(Path(sys.argv[2]).rglob("config.json")):
        try:
            runs.load_run(config.parent)
        except runs.RunRecordError:  # a damaged record: the chapter that reads it says so
            pass
    gc.freeze()  # kept out of the collector's passes in every kernel (and so not copied on write by them)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernels are reaped as they end
print("ready", file=answers, flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid:
        print(pid, file=answers, flush=True)
        continue
    break  # this is the kernel, as `python -m ipykernel_launcher ARGV` starts in job["cwd"] with job["env"]
else:
    sys.exit(0)  # the starter closed the pipe
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with the zygote
os.setsid()
answers.close()
fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(fd, 0)
os.close(fd)
os.chdir(job["cwd"])
os.environ.clear()
os.environ.update(job["env"])
if "torch" in sys.modules:  # torch seeds its default generator afresh in each process: so here too (Python's
    sys.modules["torch"].seed()  # random reseeds itself in a fork; numpy.random is not loaded yet)
import importlib.util
from ipykernel.kernelapp import IPKernelApp
sys.argv = [importlib.util.find_spec("ipykernel_launcher").origin, *job["argv"][3:]]
sys.path[0] = os.getcwd()
code = 0
# parent_handle: the one setting ipykernel takes from the environment when it is imported (here: before the
# fork), so given as the environment has it now
parent = int(os.environ.get("JPY_PARENT_PID") or 0)
try:
    IPKernelApp.launch_instance(argv=job["argv"][3:], parent_handle=parent)
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else 1
# the kernel has shut down: what exiting does but the interpreter's teardown (0.6 s with torch loaded)
import atexit
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


class Zygote:
    """A process that has imported PRELOAD, read the run records under `records` ("" for none) and forks a
    kernel on request."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, records: str = RECORDS) -> None:
        read, write = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(write), records, *preload],
                                        stdin=subprocess.PIPE, pass_fds=(write,), text=True)
        os.close(write)
        self.answers = os.fdopen(read)
        self.ready = False

    def wait_ready(self) -> None:
        """Return once the zygote has imported PRELOAD and read the records (RuntimeError if it ended)."""
        if not self.ready:
            if self.answers.readline().strip() != "ready":
                raise RuntimeError("the kernel zygote did not start")
            self.ready = True

    def fork(self, argv: list[str], cwd: str, env: dict[str, str]) -> int:
        """The pid of a new kernel started as `argv` (python -m ipykernel_launcher ...) would start."""
        self.wait_ready()
        self.process.stdin.write(json.dumps({"argv": argv, "cwd": cwd, "env": env}) + "\n")
        self.process.stdin.flush()
        return int(self.answers.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self.answers.close()


class ForkedKernel:
    """What jupyter_client's local provisioner needs of a kernel's Popen, for a kernel the zygote forked (not
    this process's child: it is reaped by the zygote, so it is alive while its pid is)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


ZYGOTE_IN_USE: Zygote | None = None  # set by the process that executes chapters (execute_chapters.py)


class ZygoteKernelManager(AsyncKernelManager):
    """AsyncKernelManager whose `python -m ipykernel_launcher` kernels come from ZYGOTE_IN_USE."""

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        global ZYGOTE_IN_USE
        if (ZYGOTE_IN_USE is None or kernel_cmd[1:3] != ["-m", "ipykernel_launcher"]
                or os.path.realpath(kernel_cmd[0]) != os.path.realpath(sys.executable)):
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        env = dict(kw.get("env") or os.environ)
        if not kw.get("independent"):
            env["JPY_PARENT_PID"] = str(os.getpid())  # as jupyter_client.launcher.launch_kernel sets it
        try:
            pid = ZYGOTE_IN_USE.fork(kernel_cmd, str(kw.get("cwd") or os.getcwd()), env)
        except (OSError, ValueError, RuntimeError) as exc:  # the zygote is gone: launch as usual from now on
            print(f"kernel_zygote: {exc!r}; kernels start from scratch", file=sys.stderr)
            ZYGOTE_IN_USE = None
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        provisioner = self.provisioner
        provisioner.process, provisioner.pid, provisioner.pgid = ForkedKernel(pid), pid, pid
        provisioner.cwd = kw.get("cwd") or os.getcwd()
        self._reconcile_connection_info(provisioner.connection_info)
