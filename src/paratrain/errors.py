"""Errors a user can cause. The CLI prints them as one line and exits with their code."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a path, a flag, a file. Reported as one line, exit code 2, no traceback."""

    exit_code = 2
    agreed = False  # True: every rank raises it alike, and rank 0 alone tells it


class AgreedUserError(UserError):
    """Raised alike on every rank (the same input, or after an agreement); rank 0 alone
    reports it, so a job of N processes prints it once."""

    agreed = True
