"""The locked dependency sets: write one from an environment, check an environment against one.

    python requirements/lock.py freeze [--header TEXT]   # the running environment's set, one ``name==version`` a line
    python requirements/lock.py check LOCK               # exit 1, naming every package that differs from LOCK
    python requirements/lock.py diff LOCK                # the same report, exit 0 (``make test-latest``)

A lock lists every installed distribution (direct and transitive, setuptools included, pip and
rlcore itself excepted) with its exact version. ``make lock`` writes ``constraints.txt`` (the main lock, at the root) and
``vllm-lock.txt`` from fresh environments resolved to the newest versions the ranges allow;
``make setup`` installs ``constraints.txt`` with ``--no-deps`` (exactly that set) and then checks it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re
import sys
from pathlib import Path

SKIP = {"pip", "rlcore"}  # the installer and the project itself are not locked


def canonical(name: str) -> str:
    """A distribution name as the package index compares it (PEP 503): ``Foo_bar.baz`` → ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """``{canonical name: version}`` of the running interpreter's distributions (first on the path wins)."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) not in SKIP:
            found.setdefault(canonical(name), dist.version)
    return found


def parse(text: str, *, source: str = "lock") -> dict[str, str]:
    """``{canonical name: version}`` of a lock's ``name==version`` lines (comments and blanks skipped)."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;,]+)", line)
        if match is None:
            raise ValueError(f"{source}:{number}: expected 'name==version', got {raw!r}")
        name = canonical(match[1])
        if name in pins:
            raise ValueError(f"{source}:{number}: {match[1]} is pinned twice ({pins[name]} and {match[2]})")
        pins[name] = match[2]
    return pins


def differences(locked: dict[str, str], present: dict[str, str]) -> list[str]:
    """One line per package that is missing, extra, or at another version than the lock's."""
    lines = [f"missing: {n}=={v}" for n, v in sorted(locked.items()) if n not in present]
    lines += [f"not in the lock: {n}=={v}" for n, v in sorted(present.items()) if n not in locked]
    lines += [f"version: {n} is {present[n]}, the lock has {v}" for n, v in sorted(locked.items())
              if n in present and present[n] != v]
    return lines


def freeze(header: str = "") -> str:
    where = f"CPython {platform.python_version()} on {platform.system()} {platform.machine()}"
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [f"# resolved and installed on {where}; written by requirements/lock.py freeze", ""]
    lines += [f"{name}=={version}" for name, version in sorted(installed().items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("freeze").add_argument("--header", default="")
    for name in ("check", "diff"):
        commands.add_parser(name).add_argument("lock", type=Path)
    args = parser.parse_args(argv)
    if args.command == "freeze":
        sys.stdout.write(freeze(args.header))
        return 0
    found = differences(parse(args.lock.read_text(), source=str(args.lock)), installed())
    if not found:
        print(f"{sys.prefix}: the installed set is {args.lock}")
        return 0
    print(f"{sys.prefix}: the installed set differs from {args.lock} in {len(found)} packages:")
    print("\n".join(f"  {line}" for line in found))
    if args.command == "check":
        print("Rebuild the environment from the lock (make clean setup), or refresh the lock (make lock).")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
