"""This turnout's release and the edition of the plugin API it serves; `turnout` exports both."""

__version__ = "0.3.0"
PLUGIN_API = 3  # the edition of the hook specs and the backend, model and executor contracts
