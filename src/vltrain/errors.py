"""Errors that are the user's to fix: the CLI prints their message, never a traceback.

Every module may raise these; this module imports nothing of vltrain, so it sits at the bottom of
the import chain.
"""


class UserError(Exception):
    """Bad input (a config, a manifest, a path). ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    """A user mistake in a config file or override."""

    exit_code = 2


class UsageError(UserError):
    """A source that does not exist or is not a known format: the command was misused."""

    exit_code = 2


class DataError(UserError):
    """A data source cannot be used as given (all samples bad, too many bad, malformed manifest)."""


class NonFiniteError(UserError):
    """Too many non-finite steps in a row: the run is diverging, not hitting a bad sample."""

    exit_code = 3
