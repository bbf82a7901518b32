"""Tool-call parsers: where a model family writes its calls in the output text, and how a
stream of text becomes OpenAI ``tool_calls`` (complete or as incremental deltas).

Each parser answers one question about the text generated so far: where the content ends
and where the tool-call region begins (``split``). The region is read by the shared scanner
(:mod:`.scan`), so every family streams the same way: a call's id and name once its name has
closed, then its arguments as they grow. ``--tool-call-parser`` picks one of ``PARSERS``;
``auto`` picks from the chat template.
"""

from __future__ import annotations

from roofline.entrypoints.openai.tool_parsers.parsers import (
    PARSERS,
    ToolParser,
    default_parser_name,
    get_tool_parser,
)

__all__ = ["PARSERS", "ToolParser", "default_parser_name", "get_tool_parser"]
