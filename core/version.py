"""This turnout's release and the edition of the plugin API it serves; `turnout` exports both."""

__version__ = "0.2.5"
PLUGIN_API = 2  # the edition of the hook specs and the backend, model and executor contracts
