"""`cursusctl` console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("cursusctl: not yet available", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
