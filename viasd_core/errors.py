"""User-facing errors: one line that names the problem and the fix."""


class ViasdError(Exception):
    """An error caused by the user's input or environment, shown as one line (no traceback)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class UsageError(ViasdError):
    """Bad command-line input: exit code 2."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=2)
