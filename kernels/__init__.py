"""Kumo kernels."""
