"""``python -m tensorstash``: the same as the ``tensorstash`` command."""

from __future__ import annotations

from tensorstash.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
