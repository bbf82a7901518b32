"""The OpenAI-compatible HTTP server: protocol models, handlers, metrics and its CLI.

Importing this package is cheap (no FastAPI); ``server`` pulls in the web stack.
"""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body the server accepts unless ``--max-body-bytes`` says otherwise."""
