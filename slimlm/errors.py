"""Errors a user can fix: each message names what is wrong and what to do about it."""


class SlimlmError(Exception):
    """A problem caused by input (config, paths, data); the CLI prints it as one line, exit 2."""


class ConfigError(SlimlmError):
    """A config key or value is wrong; raised before any model or data is loaded."""
