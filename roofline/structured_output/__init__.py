"""Structured outputs: requests whose output must match a JSON schema, a regex, a choice or a
grammar. ``params`` holds the user-facing constraint, ``backend`` the seam to a grammar library
(xgrammar by default), ``manager`` the engine's compile cache, matchers and logits masking."""

from roofline.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
