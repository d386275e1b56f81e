"""Helpers shared by the command modules: the app context, consoles, loading what a command needs."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click


def pass_app(f):
    """Pass the AppContext (global options) as the first argument."""

    @click.pass_context
    @functools.wraps(f)
    def wrapper(ctx, *args, **kwargs):
        return f(ctx.find_root().obj, *args, **kwargs)

    return wrapper


_consoles: dict[bool, object] = {}


def console(stderr: bool = False):
    from rich.console import Console

    if stderr not in _consoles:
        _consoles[stderr] = Console(stderr=stderr, highlight=False, soft_wrap=False)
    return _consoles[stderr]


def resolved_models_dir(app) -> Path:
    from orchestrator.config.manifest import models_dir

    return models_dir(app.models_dir)


def load_host_entry(app, name: str):
    from orchestrator.config.inventory import get_host, load_inventory

    return get_host(load_inventory(app.inventory_path), name)


def load_model(app, name: str):
    from orchestrator.config.manifest import get_manifest

    return get_manifest(name, resolved_models_dir(app))[0]


def is_tty() -> bool:
    return sys.stdout.isatty()


def terminal_ask(as_json: bool):
    """A yes/no question on the terminal, or None when there is no one to ask (--json, no terminal):
    then a plan that needs confirmation is refused unless --yes."""
    if as_json or not sys.stdin.isatty() or not sys.stdout.isatty():
        return None
    return lambda question: click.confirm(question, default=False)
