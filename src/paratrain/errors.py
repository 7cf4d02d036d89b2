"""Errors a user can cause. The CLI prints them as one line and exits 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: a path, a flag, a file. Reported as one line, exit code 2, no traceback."""

    exit_code = 2
