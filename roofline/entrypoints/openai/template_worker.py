"""The worker process that renders request-supplied chat templates (run as a script, ``python
-I template_worker.py MAX_CHARS MEMORY_BYTES``, so it imports jinja2 and nothing of roofline or
torch).

It reads one JSON object per line on stdin (``{"template", "context"}``) and answers one per
line on stdout: ``{"text"}``, or ``{"error"}`` for any exception the render raised (a template
error, a division by zero, the sandbox's limits, recursion, running out of its address-space
limit, an output over ``MAX_CHARS`` characters). Rendering happens in jinja2's immutable
sandbox; the parent bounds its time by killing the process (:mod:`.chat_template`). The worker
exits when stdin closes (its parent is gone).
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise TemplateError(message)


def render(env: ImmutableSandboxedEnvironment, request: dict[str, Any], max_chars: int) -> str:
    chunks: list[str] = []
    num_chars = 0
    for chunk in env.from_string(request["template"]).generate(**request["context"]):
        num_chars += len(chunk)
        if num_chars > max_chars:
            raise ValueError(f"the rendered prompt is over {max_chars} characters")
        chunks.append(chunk)
    return "".join(chunks)


def main() -> None:
    max_chars, memory_bytes = int(sys.argv[1]), int(sys.argv[2])
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    for line in sys.stdin.buffer:
        try:
            reply = {"text": render(env, json.loads(line), max_chars)}
        except Exception as e:  # noqa: BLE001 - every failure of a render is the template's
            reply = {"error": f"{type(e).__name__}: {e}"[:2000]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
