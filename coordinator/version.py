"""quiesce's version: the one place it is written (pyproject reads it from here at build time)."""

from __future__ import annotations

from typing import Final

VERSION: Final = "0.1.0"
