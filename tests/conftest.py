"""Makes the shared test helpers (tests/tiny_models.py) importable as ``tiny_models``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
