"""A griffe extension for the documentation site: lamina's ``Example:`` sections are examples.

lamina's docstrings head their doctests ``Example:`` (Google style's singular). griffe's Google
parser reads only ``Examples:`` as an examples section and renders anything else as an
admonition of Markdown text, where ``>>> variables["params"]["kernel"]`` reads as a reference
link. This extension renames the heading, in griffe's copy of each docstring only, so the
doctests render as Python code. The docstrings themselves (and the doctests the test suite
runs from them) are untouched.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Reads a docstring's ``Example:`` heading as ``Examples:``."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Renames the heading in the object's docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
