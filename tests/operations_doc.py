"""The fenced blocks of docs/operations.md that tests run or compare
(``<!-- step: NAME -->`` marks each); ``ROOT`` the repository.  Test
modules take them from here, never from one another."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "operations.md")


def doc_block(step: str) -> str:
    """The fenced block right after ``<!-- step: NAME -->`` in the page."""
    with open(DOC) as f:
        text = f.read()
    match = re.search(rf"<!-- step: {re.escape(step)} -->\n```[a-z]*\n(.*?)```", text, re.S)
    assert match, f"docs/operations.md has no step {step!r}"
    return match.group(1)
