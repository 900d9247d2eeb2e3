"""Kumo schemas."""
