"""The HTTP API (DESIGN §3) and the pages; ``create_app(settings, runtime=None)``."""

from ephemeral.api.app import create_app

__all__ = ["create_app"]
