"""loops.sandbox: each limit of run_python met by code that tries to pass it, and python_tool's formatting."""

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from rlcore.loops.sandbox import python_tool, run_python

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox uses POSIX resource limits and sessions")


def scratch_folders() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rlcore-sandbox-*")}


def test_normal_output():
    r = run_python("import math\nprint(math.factorial(5))\nprint('é')")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated) == ("120\né\n", "", 0, False, False)


def test_an_exception_goes_to_stderr_with_a_nonzero_exit():
    r = run_python("x = 1\nraise ValueError('boom')")
    assert r.exit_code == 1 and not r.timed_out
    assert 'File "<sandbox>", line 2' in r.stderr and "raise ValueError('boom')" in r.stderr
    assert r.stderr.rstrip().endswith("ValueError: boom") and "<string>" not in r.stderr
    assert run_python("import sys; sys.exit(7)").exit_code == 7


def test_an_infinite_loop_is_stopped_at_the_wall_clock_limit():
    start = time.perf_counter()
    r = run_python("while True: pass", timeout_s=0.5)
    assert r.timed_out and r.exit_code < 0
    assert time.perf_counter() - start < 1.5


def test_the_cpu_limit_stops_a_busy_loop():
    r = run_python("while True: pass", timeout_s=5.0, cpu_s=1)
    assert not r.timed_out and r.exit_code in (-24, -9)  # SIGXCPU at the soft limit, SIGKILL at the hard one


def test_a_fork_bomb_is_contained_and_the_host_still_spawns():
    r = run_python("import os\nwhile True:\n    os.fork()", timeout_s=1.0)
    assert r.exit_code == 1 and "PermissionError" in r.stderr and "os.fork" in r.stderr
    r = run_python("import subprocess; subprocess.run(['true'])", timeout_s=1.0)
    assert r.exit_code == 1 and "subprocess.Popen" in r.stderr
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="RLIMIT_NPROC does not bind root")
def test_a_native_fork_bomb_meets_the_process_limit():
    code = ("import ctypes, os, time\nlibc = ctypes.CDLL(None)\nn = 0\n"
            "while n < 10_000 and libc.fork() >= 0:\n    n += 1\n"
            "print('refused after', n, flush=True)\ntime.sleep(30)")
    start = time.perf_counter()
    r = run_python(code, timeout_s=1.0, max_processes=4)
    assert time.perf_counter() - start < 2.0
    assert "refused after" in r.stdout
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_what_a_native_fork_leaves_behind_is_killed_with_the_group():
    code = ("import ctypes, os, sys, time\npid = ctypes.CDLL(None).fork()\n"
            "if pid == 0:\n    time.sleep(30)\n    os._exit(0)\nprint(pid, flush=True)")
    start = time.perf_counter()
    r = run_python(code, timeout_s=3.0)
    assert time.perf_counter() - start < 2.0 and not r.timed_out  # the orphan held stdout open: killed, not waited on
    orphan = int(r.stdout.split()[0])
    for _ in range(50):
        try:  # gone, or a zombie its new parent has not reaped yet
            if Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"process {orphan} outlived the sandbox")


def test_a_huge_allocation_fails():
    r = run_python("b = bytearray(10 * 2**30)")
    assert r.exit_code == 1 and r.stderr.rstrip().endswith("MemoryError")


def test_sockets_are_refused():
    r = run_python("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))")
    assert r.exit_code == 1 and "PermissionError: sandbox: socket." in r.stderr
    r = run_python("import socket; socket.getaddrinfo('localhost', 80)")
    assert r.exit_code == 1 and "socket.getaddrinfo" in r.stderr


def test_writes_outside_the_scratch_folder_are_refused(tmp_path):
    target = tmp_path / "outside.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os; os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import os; os.symlink({str(tmp_path)!r}, 'link'); open('link/outside.txt', 'a')",
                 f"import os; os.chdir({str(tmp_path)!r}); open('outside.txt', 'x')",
                 f"import os; os.rename('/etc/hostname', {str(target)!r})",
                 f"import os; fd = os.open({str(tmp_path)!r}, os.O_RDONLY); os.open('outside.txt', os.O_CREAT, dir_fd=fd)"):
        r = run_python(code)
        assert r.exit_code == 1 and "PermissionError: sandbox:" in r.stderr, (code, r.stderr)
    assert not target.exists()
    (tmp_path / "keep.txt").write_text("x")
    r = run_python(f"import os; os.remove({str(tmp_path / 'keep.txt')!r})")
    assert r.exit_code == 1 and (tmp_path / "keep.txt").exists()


def test_the_scratch_folder_is_the_cwd_writable_and_removed_afterwards():
    before = scratch_folders()
    code = ("import os, tempfile\nos.makedirs('a/b')\nopen('a/b/f.txt', 'w').write('hi')\n"
            "print(open('a/b/f.txt').read(), os.getcwd(), tempfile.gettempdir() == os.getcwd())\n"
            "os.chmod('a', 0o500)")
    r = run_python(code)
    assert r.exit_code == 0, r.stderr
    text, cwd, tmp_is_cwd = r.stdout.split()
    assert text == "hi" and tmp_is_cwd == "True" and Path(cwd).name.startswith("rlcore-sandbox-")
    assert not Path(cwd).exists() and scratch_folders() == before


def test_the_file_size_limit():
    r = run_python("open('big', 'wb').write(b'x' * (3 << 20))", max_file_mb=1)
    assert r.exit_code == 1 and "File too large" in r.stderr


def test_the_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    monkeypatch.setenv("SECRET_TOKEN", "x")
    r = run_python("import os, sys; print(sorted(os.environ)); print(sys.flags.isolated)")
    names, isolated = r.stdout.splitlines()
    assert "HTTPS_PROXY" not in names and "SECRET_TOKEN" not in names and "PATH" in names and isolated == "1"


def test_huge_output_is_truncated_with_bounded_reads():
    r = run_python("import sys\nsys.stdout.write('x' * 5_000_000)\nsys.stderr.write('e' * 100)", max_output_chars=1000)
    assert r.truncated and r.stdout == "x" * 1000 and r.stderr == "e" * 100 and r.exit_code == 0


def test_python_tool_formats_the_result():
    assert python_tool("print(6 * 7)") == "42"
    assert python_tool("pass") == "(no output)"
    failed = python_tool("print('a')\n1/0")
    assert failed.startswith("a\nstderr:\nTraceback") and "ZeroDivisionError" in failed
    assert failed.endswith("exit code 1")
