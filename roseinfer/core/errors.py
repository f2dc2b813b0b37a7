"""User-facing errors. Each names the field at fault and says what to do."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; ``code`` is the Redis protocol error code."""

    def __init__(self, field: str, message: str, code: str = "bad_request"):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message
        self.code = code


class ConfigError(ValueError):
    """A bad engine configuration value."""


def short(value, width: int = 60) -> str:
    """repr() of a client's value, cut short: an error message must not carry megabytes."""
    text = repr(value)
    return text if len(text) <= width else text[:width] + f"... ({len(text)} characters)"
