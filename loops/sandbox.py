"""Running model-written Python in a limited subprocess: :func:`run_python` and the tool :func:`python_tool`.

Each run is a fresh ``python -I -B`` (no user site, no ``PYTHON*`` variables, no bytecode
written) in a new temporary scratch folder, its working directory, deleted afterwards. A bootstrap
runs first, in the child, before it reads the code from its stdin:

- resource limits, soft and hard alike so the code cannot raise them again: ``RLIMIT_CPU``
  (``cpu_s`` seconds of CPU, then SIGXCPU / SIGKILL), ``RLIMIT_AS`` (``memory_mb`` of address
  space: a larger allocation raises ``MemoryError``), ``RLIMIT_NPROC`` (the user's current number
  of processes and threads plus ``max_processes``), ``RLIMIT_FSIZE`` (``max_file_mb`` per file
  written; SIGXFSZ is ignored so the write fails with ``OSError``), ``RLIMIT_NOFILE``
  (``max_open_files``) and ``RLIMIT_CORE`` 0. They are set by the child itself rather than in a
  ``preexec_fn``, which the ``subprocess`` documentation calls unsafe with threads (and
  :func:`rlcore.loops.tools.call_tool` runs tools in threads); no code of the caller's has run by then;
- an audit hook (``sys.addaudithook``) refusing with ``PermissionError``: every ``socket.*`` event
  (creating a socket, connecting, resolving names), starting processes (``subprocess.Popen``,
  ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``, ``os.fork``, ``pty.spawn``),
  signals to other processes (``os.kill``, ``os.killpg``), changing resource limits, writes
  outside the scratch folder (``open`` for writing, removing, renaming, linking, ``chmod``...) and
  ``os.open`` of a folder outside it (whose descriptor, as a ``dir_fd``, would reach past the check).

The environment is stripped to a minimal ``PATH``, ``HOME`` and ``TMPDIR`` set to the scratch
folder, and one thread for the BLAS / OpenMP pools: no proxy or credential variables reach it.
The child runs in a new session (``start_new_session=True``); at ``timeout_s`` seconds of wall
clock, and in any case once it ends, its whole process group is killed. Its stdout and stderr are
read to a bounded size (the rest is drained and dropped), never into unbounded memory.

What protects the host, and what does not:

- The audit hook is a guardrail against ordinary Python code, not a security boundary: it lives in
  the interpreter it watches, and native code (``ctypes``, an extension module) can bypass it.
  Reading files is not restricted.
- The rlimits and the process-group kill are enforced by the kernel. ``RLIMIT_NPROC`` does not
  bind a process with ``CAP_SYS_RESOURCE`` or ``CAP_SYS_ADMIN`` (root, in most containers): run as
  root, only the hook stands between the code and ``fork``. A process that leaves the group
  (``setsid`` from native code) escapes the kill.
- There is no network namespace without privileges: untrusted code that must not reach a network
  belongs in a container or VM with none.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["SandboxResult", "run_python", "python_tool"]

_BOOTSTRAP = r"""
import linecache, os, resource, signal, sys, traceback
cpu_s, memory_mb, nproc, file_mb, nofile = map(int, sys.argv[1:6])
for kind, soft, hard in ((resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_AS, memory_mb << 20, memory_mb << 20),
                         (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_FSIZE, file_mb << 20, file_mb << 20),
                         (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_CORE, 0, 0)):
    ceiling = resource.getrlimit(kind)[1]  # never above the limit this process already has
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(kind, (soft, hard))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
code = sys.stdin.read()
sys.argv = ["<sandbox>"]
scratch = os.path.realpath(os.getcwd())
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (1,),
         "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,),
         "shutil.rmtree": (0,), "os.chflags": (0,), "os.lchown": (0,), "os.setxattr": (0,), "os.removexattr": (0,)}
REFUSED = ("subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
           "pty.spawn", "os.kill", "os.killpg", "resource.setrlimit", "resource.prlimit", "os.startfile")

def inside(path, scratch=scratch, realpath=os.path.realpath, fsdecode=os.fsdecode, sep=os.sep):
    if isinstance(path, int):
        return True  # an open file descriptor: it was checked when it was opened
    path = realpath(fsdecode(path))
    return path == scratch or path.startswith(scratch + sep)

def hook(event, args, refused=REFUSED, paths=PATHS, write=WRITE, inside=inside, isdir=os.path.isdir):
    if event.startswith("socket.") or event in refused:
        raise PermissionError(f"sandbox: {event} is refused (no network, no processes)")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (int(flags or 0) & write)
        if path is not None and not inside(path):
            if writing:
                raise PermissionError(f"sandbox: writing outside the scratch folder is refused: {path!r}")
            if mode is None and isdir(path):  # os.open of a folder: a dir_fd would reach writes past this hook
                raise PermissionError(f"sandbox: opening a folder outside the scratch folder is refused: {path!r}")
    elif event in paths:
        for i in paths[event]:
            if i < len(args) and args[i] is not None and not inside(args[i]):
                raise PermissionError(f"sandbox: {event} outside the scratch folder is refused: {args[i]!r}")

sys.addaudithook(hook)
del hook, inside, scratch, REFUSED, PATHS, WRITE
linecache.cache["<sandbox>"] = (len(code), None, code.splitlines(True), "<sandbox>")
try:
    exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxResult:
    """What a :func:`run_python` run left: its output, how it ended, and whether output was cut.

    ``exit_code`` is the child's status: 0, the code's ``sys.exit`` value, 1 for an uncaught
    exception, or ``-signal`` when a signal ended it (``-SIGKILL`` after the wall-clock limit or the
    hard CPU limit, ``-SIGXCPU`` at the soft CPU limit). ``timed_out`` says the wall-clock limit was
    reached; ``truncated`` that stdout or stderr passed ``max_output_chars``."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    truncated: bool


def _user_tasks() -> int:
    """Processes and threads of this real user now (Linux ``/proc``; 0 where it cannot be read)."""
    uid, total = str(os.getuid()), 0
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return 0
    for pid in entries:
        try:
            with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # gone since the listing, or not ours to read
        if fields.get("Uid", "").split()[:1] == [uid]:
            total += int(fields.get("Threads", "1").strip() or 1)
    return total


def _drain(stream, limit: int, out: list[bytes], cut: list[bool]) -> None:
    """Reads ``stream`` to its end, keeping its first ``limit`` bytes in ``out``; ``cut[0]`` says more came."""
    kept = total = 0
    while chunk := stream.read(65536):
        total += len(chunk)
        if kept < limit:
            out.append(chunk[:limit - kept])
            kept += len(out[-1])
    cut[0] = total > limit


def _decode(parts: list[bytes], max_chars: int) -> tuple[str, bool]:
    text = b"".join(parts).decode("utf-8", errors="replace")
    return (text[:max_chars], True) if len(text) > max_chars else (text, False)


def _remove(folder: str) -> None:
    """Deletes ``folder``, making read-only or unlistable entries writable first."""
    def retry(func, path, _):
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        func(path)
    try:
        shutil.rmtree(folder, onerror=retry)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already empty
        os.killpg(pid, signal.SIGKILL)


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: int = 5, memory_mb: int = 512,
               max_output_chars: int = 10_000, max_processes: int = 8, max_file_mb: int = 16,
               max_open_files: int = 64, python: str = sys.executable) -> SandboxResult:
    """Runs ``code`` in a fresh, limited ``python`` subprocess (see the module's docstring for each limit).

    Args:
        code: Python source, run as ``__main__``; its stdin is empty.
        timeout_s: wall-clock seconds before its process group is killed (``timed_out``).
        cpu_s: CPU seconds (``RLIMIT_CPU``).
        memory_mb: address space in MiB (``RLIMIT_AS``).
        max_output_chars: characters kept of stdout and of stderr each (``truncated`` past it).
        max_processes: processes and threads it may add to the user's current count (``RLIMIT_NPROC``).
        max_file_mb: largest file it may write, in MiB (``RLIMIT_FSIZE``).
        max_open_files: file descriptors it may hold (``RLIMIT_NOFILE``).
        python: the interpreter; the running one by default.

    Returns:
        A :class:`SandboxResult`. Nothing the code does raises here; an ``OSError`` means the
        interpreter itself could not be started.
    """
    scratch = tempfile.mkdtemp(prefix="rlcore-sandbox-")
    env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    limits = [str(int(v)) for v in (max(1, cpu_s), max(16, memory_mb), _user_tasks() + max(1, max_processes),
                                     max(0, max_file_mb), max(16, max_open_files))]
    limit_bytes = 4 * max_output_chars + 4  # UTF-8: at most 4 bytes a character
    out: list[bytes] = []
    err: list[bytes] = []
    cut_bytes = [[False], [False]]
    try:
        proc = subprocess.Popen([python, "-I", "-B", "-c", _BOOTSTRAP, *limits], cwd=scratch, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
        try:
            readers = [threading.Thread(target=_drain, args=(s, limit_bytes, o, c), daemon=True)
                       for s, o, c in ((proc.stdout, out, cut_bytes[0]), (proc.stderr, err, cut_bytes[1]))]
            for r in readers:
                r.start()
            deadline = time.monotonic() + timeout_s
            try:
                proc.stdin.write(code.encode("utf-8", errors="surrogateescape"))
                proc.stdin.close()
            except OSError:
                pass  # the child ended before reading all of it; its status says why
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
        finally:
            _kill_group(proc.pid)  # the child on time-out, and whatever it left behind in any case
            proc.wait()
        for r in readers:
            r.join(timeout=1.0)
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    finally:
        _remove(scratch)
    stdout, cut_out = _decode(out, max_output_chars)
    stderr, cut_err = _decode(err, max_output_chars)
    return SandboxResult(stdout, stderr, proc.returncode, timed_out, cut_out or cut_err or cut_bytes[0][0] or cut_bytes[1][0])


def python_tool(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    The code runs in a fresh interpreter with no network, a few seconds of time and limited memory;
    only its printed output comes back, so print every value you need.

    Args:
        code: The Python source to run.

    Returns:
        Its stdout, then its stderr, its exit code and whether it timed out when there is any.
    """
    result = run_python(code)
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("stderr:\n" + result.stderr.rstrip("\n"))
    if result.timed_out:
        parts.append("timed out: the code was stopped at the time limit")
    elif result.exit_code != 0:
        parts.append(f"exit code {result.exit_code}")
    if result.truncated:
        parts.append("[output truncated]")
    return "\n".join(parts) if parts else "(no output)"
