"""Shared test settings: quiet progress bars, one torch thread pool size, fixed seeds."""

from __future__ import annotations

import os

os.environ.setdefault("ROOFLINE_NO_PROGRESS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
