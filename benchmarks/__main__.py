"""``python -m benchmarks``: run every benchmark and write the report (see run.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run import main

if __name__ == "__main__":
    sys.exit(main())
