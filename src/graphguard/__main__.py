"""``python -m graphguard``: the same as the ``graphguard`` command (see :mod:`graphguard.cli`)."""

from __future__ import annotations

import sys

from graphguard.cli import main

if __name__ == "__main__":
    sys.exit(main())
