"""OpenAI-compatible HTTP server for jaxpaged (aiohttp)."""

from server.app import create_app

__all__ = ["create_app"]
