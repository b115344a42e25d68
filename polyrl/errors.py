"""User-facing errors.

A `UserError` is bad input (config, data, paths, user code): the CLI prints its message as the last line, with no
traceback (set POLYRL_DEBUG=1 to see one). Its message is one sentence naming the file, key or value and the fix.
Anything else is a bug in polyrl and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user; the message says what is wrong and what to do instead."""


class ConfigError(UserError):
    """A config key or value is wrong."""


class DataError(UserError):
    """A data file or sample is wrong."""


class RewardError(UserError):
    """A reward function is missing, raised, or returned a bad value."""
