"""Why localspec chose something, said at two lengths.

A choice's reason is built once, where the choice is made, in both forms: the full explanation
(the numbers, the command that would change it) and a few words for the first thing a person
reads (the chat's side panel, the CLI's first line, the server's ready line). The full text is the
string itself, so the reports, `--json` and the statistics that have always carried a reason as a
plain string keep carrying the full one.
"""

from __future__ import annotations


class Reason(str):
    """The full explanation, with `short` beside it: one line of a few words, no parentheses."""

    short: str

    def __new__(cls, full: str, short: str) -> Reason:
        reason = super().__new__(cls, full)
        reason.short = short
        return reason

    def __getnewargs__(self) -> tuple[str, str]:
        # copies and pickles (dataclasses.asdict deep-copies what it holds) keep both forms
        return str(self), self.short
