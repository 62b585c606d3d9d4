"""Model architectures: the registry entry a plugin returns, and the shared decoder they build on."""

from turnout.models.registry import ModelArchitecture

__all__ = ["ModelArchitecture"]
