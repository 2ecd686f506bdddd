"""Errors that are the user's to fix: the CLI prints their message, never a traceback."""


class UserError(Exception):
    """Bad input (a config, a manifest, a path). ``exit_code`` 2 for usage, 1 otherwise."""

    exit_code = 1


class DataError(UserError):
    """A data source cannot be used as given (all samples bad, too many bad, malformed manifest)."""
