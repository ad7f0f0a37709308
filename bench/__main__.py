"""Run every ``bench/bench_*.py`` module and print each result dict as one JSON line.

Usage: ``python -m bench`` (all modules but ``compare``) or ``python -m bench wire storage`` (only the
named ones, without the ``bench_`` prefix). ``python -m bench compare`` runs the side-by-side comparison
with RabbitMQ Streams and Redis (:mod:`bench.bench_compare`), which needs those servers installed.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

#: Modules run only when named: they start third-party servers and take minutes.
_ON_REQUEST = {"bench_compare"}


def _module_names(selected: list[str]) -> list[str]:
    names = sorted(path.stem for path in Path(__file__).resolve().parent.glob("bench_*.py"))
    if selected:
        wanted = {f"bench_{name.removeprefix('bench_')}" for name in selected}
        return [name for name in names if name in wanted]
    return [name for name in names if name not in _ON_REQUEST]


def main(argv: list[str]) -> int:
    """Import and run the bench modules; return a process exit code.

    A module that fails prints one ``{"module": ..., "error": ...}`` line and the run
    goes on with the next module; the exit code is then 1. An option (``-h``, ``--help``) or a name that
    is no bench module prints the usage and runs nothing (exit 0 for help, 2 otherwise).
    """
    known = {name.removeprefix("bench_") for name in (*_module_names([]), *_ON_REQUEST)}
    unknown = [name for name in argv if name.removeprefix("bench_") not in known]
    if unknown:
        help_asked = all(name in ("-h", "--help") for name in unknown)
        print((__doc__ or "").strip() + "\n\nmodules: " + " ".join(sorted(known)),
              file=sys.stdout if help_asked else sys.stderr)
        if not help_asked:
            print(f"unknown bench module(s): {' '.join(unknown)}", file=sys.stderr)
        return 0 if help_asked else 2
    failed = False
    for name in _module_names(argv):
        try:
            module = importlib.import_module(f"bench.{name}")
            results = module.run()
        except Exception as exc:  # one broken bench must not hide the others' numbers
            failed = True
            print(json.dumps({"module": name, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
            continue
        for result in results:
            print(json.dumps({"module": name, **result}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
