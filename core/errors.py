"""User-facing errors: each message is one line that names the problem and the fix."""


class TurnoutError(Exception):
    """Base for errors the CLI prints as one line and exits non-zero on."""


class ConfigError(TurnoutError):
    """A setting that cannot be used: an unknown key, a bad value, or settings that cannot run together;
    the message names the setting, where it came from where that matters, and the fix."""


class SelectionError(TurnoutError):
    pass


class WeightLoadError(TurnoutError):
    """A checkpoint that cannot be loaded as config.json describes it: a missing, extra, misshapen or
    mistyped tensor, or an unreadable file. The message names the tensor or file."""


class RequestError(TurnoutError, ValueError):
    """A bad request; it fails alone and leaves the engine untouched."""


def one_line(err: BaseException) -> str:
    """The error's message on one line, runs of whitespace and newlines as single spaces."""
    return " ".join(str(err).split())
