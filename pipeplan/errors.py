"""Error types shared by every layer.

The CLI maps `UserError` to exit code 2 and a single line; anything else is an
internal error (exit 1). Raise `UserError` whenever the user can fix the cause
(a file, a flag, a model, a memory limit), and say what to do in `hint`.
"""


class UserError(Exception):
    """Something the user can fix. `str()` is the one line the CLI prints."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class InfeasibleError(UserError):
    """No plan fits the devices' memory; the message says by how much."""
