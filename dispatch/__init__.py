"""Choosing a kernel configuration for each merge call."""


class InvalidSetting(ValueError):
    """A ``KVSPLIT_*`` environment variable holds a value kvsplit cannot use; the message names it.

    Defined here, away from the dispatcher and torch, so that the command line
    can tell it from other errors without importing them.
    """
