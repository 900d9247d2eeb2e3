"""Kumo gateway."""
