"""Shared test settings: the repository root on sys.path, so `handler` and `scripts` import as in the archive."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
