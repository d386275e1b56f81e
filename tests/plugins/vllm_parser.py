"""Fixtures: see tests/conftest.py."""
