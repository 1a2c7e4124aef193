"""Helpers for testing distributed code on CPU: run a function on several gloo ranks."""

from unison.testing.runner import run_distributed

__all__ = ["run_distributed"]
