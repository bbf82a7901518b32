"""The OpenAI-compatible HTTP server: protocol models, handlers, metrics and its CLI.

Importing this package is cheap (no FastAPI); ``server`` pulls in the web stack.
"""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body the server accepts unless ``--max-body-bytes`` says otherwise."""

DEFAULT_MAX_SEQS_PER_REQUEST = 256
"""Most sequences (prompts x ``n``) one request may start unless ``--max-seqs-per-request``
raises it (400 beyond)."""

DEFAULT_SERVER_MAX_NUM_WAITING = 4096
"""``roofline serve``'s waiting-queue limit (sequences) unless ``--max-num-waiting`` sets one
(429 beyond); the engine itself (``LLM``) has none by default."""
