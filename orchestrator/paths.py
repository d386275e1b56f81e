"""Where the shipped models/, templates/ and hosts.example.yaml are: the source checkout, else inside
the wheel."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    """`models` or `templates`: the repo's top-level folder in a checkout, else the wheel's copy."""
    checkout = _PKG.parent / name
    if checkout.is_dir() and (_PKG.parent / "pyproject.toml").is_file():
        return checkout
    return _PKG / "_shipped" / name


def example_inventory() -> Path:
    """hosts.example.yaml, the commented example inventory: the checkout's, else the wheel's copy."""
    checkout = _PKG.parent / "hosts.example.yaml"
    if checkout.is_file() and (_PKG.parent / "pyproject.toml").is_file():
        return checkout
    return _PKG / "_shipped" / "hosts.example.yaml"


def package_file(*parts: str) -> Path:
    """A file inside the orchestrator package (host-side scripts, sim programs)."""
    return _PKG.joinpath(*parts)
