"""The one exception type for bad user input: the CLI prints its message on one line and exits 2."""


class UserError(ValueError):
    """Bad input (spec, file, option, a plan that cannot fit); the message names the fix."""
