"""User-facing errors: the command-line entry points print these as one short line and exit 2."""


class UserError(Exception):
    """Bad input from the user (missing path, unknown model, corrupt checkpoint, ...).

    The message must be complete and short: the CLI prints `error: <message>` and exits
    with status 2, never a traceback.
    """
