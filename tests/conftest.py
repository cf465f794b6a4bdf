"""Test configuration: make the test helpers importable as plain modules, and check the model's
invariants after every pipeline step of every conversion the tests run (child processes
included; ``MIXPREC_CHECK_STEPS=0`` in the environment turns it off)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("MIXPREC_CHECK_STEPS", "1")
