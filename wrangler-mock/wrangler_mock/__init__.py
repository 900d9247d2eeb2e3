"""wrangler-mock: run Python Workers locally against a Kumo gateway."""

__version__ = "0.1.0"
