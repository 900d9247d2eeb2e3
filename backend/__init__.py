"""Kumo backend."""
