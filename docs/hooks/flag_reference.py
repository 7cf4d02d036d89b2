"""MkDocs hook: the flag reference page is made from the settings schema at build time.

``docs/reference.md`` holds only the markers; the tables between them come from
:func:`paratrain.cli.flag_reference`, the one source ``--help`` and the checks also read,
so the published reference cannot drift from the code.
"""

from __future__ import annotations

from typing import Any

START = "<!-- flag-reference: made by paratrain.cli.flag_reference -->"
END = "<!-- /flag-reference -->"


def fill(markdown: str) -> str:
    """``markdown`` with the schema's flag tables between the markers."""
    from paratrain.cli import flag_reference

    if START not in markdown or END not in markdown:
        return markdown
    head, rest = markdown.split(START, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{START}\n{flag_reference()}{END}{tail}"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return fill(markdown)
