"""The one way to run a host-side script (orchestrator/host/remote/*.py) with the HOST's Python.

    python - ARG...        with the script's text on stdin

Nothing is uploaded (a dry run leaves no file behind, and there is no remote path to keep in step
with the controller's version), the process list shows `python - --repo ...` rather than the whole
program, and the same command runs (`run`, one JSON answer) or streams (`stream`, lines as they come;
`stream_events`, the JSON-line events of the download and the warm-up). Arguments are plain argv
words (JSON for structured requests); secrets never go on a command line: the download reads its
token from a 0600 file.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Mapping, Sequence
from functools import cache

from orchestrator.host.base import Host, Result, Script
from orchestrator.paths import package_file

FALLBACK_USER = "nobody"     # what a venv's code runs as before the service user exists (never root)


@cache
def source(name: str) -> bytes:
    """The text of orchestrator/host/remote/<name>."""
    return package_file("host", "remote", name).read_bytes()


def as_user(user: str | None) -> str:
    """The shell words before a command that run it as `user` when root runs it (setpriv, util-linux:
    that user's uid, gid and groups, no new privileges, its HOME), and as itself otherwise (a process
    host of one user cannot switch, and needs not). "" for no user or root. Before the user exists
    (a fresh host's preflight: the plan's `user` step makes it later) it runs as `nobody`; without
    either the command fails (setpriv's error): it never falls back to root."""
    if not user or user == "root":
        return ""
    return (f'if [ "$(id -u)" = 0 ]; then u={shlex.quote(user)}; id -u -- "$u" >/dev/null 2>&1 || u={FALLBACK_USER}; '
            'H=$(getent passwd -- "$u" | cut -d: -f6); set -- env HOME="${H:-/}" USER="$u" LOGNAME="$u" '
            'setpriv --reuid="$u" --regid="$(id -g -- "$u")" --init-groups --no-new-privs --; '
            'else set --; fi; exec "$@" ')


def command(python: str, name: str, args: Sequence[str] = (), user: str | None = None) -> Script:
    """The shell command (the script itself goes on stdin); plans show it as `python <vllm-orch NAME> ARGS`
    (`as USER: ...` when it runs as the unprivileged `user`: a script that runs a venv's Python)."""
    words = [shlex.quote(python), "-", *map(shlex.quote, args)]
    shown = " ".join([shlex.quote(python), f"<vllm-orch {name}>", *map(shlex.quote, args)])
    prefix = as_user(user)
    return Script(prefix + " ".join(words), display=(f"as {user}: " if prefix else "") + shown)


def run(host: Host, python: str, name: str, args: Sequence[str] = (), *, timeout: float = 180.0,
        env: Mapping[str, str] | None = None, user: str | None = None) -> Result:
    return host.run(command(python, name, args, user), input=source(name), timeout=timeout, env=env)


def run_json(host: Host, python: str, name: str, args: Sequence[str] = (), *,
             timeout: float = 180.0, user: str | None = None) -> tuple[dict | None, Result]:
    """Run a script that answers with one JSON object on its last JSON line: (that object, Result).
    `user`: as that unprivileged user when root runs it (as_user)."""
    result = run(host, python, name, args, timeout=timeout, user=user)
    for line in reversed(result.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                break
            return (value if isinstance(value, dict) else None), result
    return None, result


def stream(host: Host, python: str, name: str, args: Sequence[str], *, on_line: Callable[[str], None],
           timeout: float = 3600.0, env: Mapping[str, str] | None = None) -> Result:
    """Run a script, calling on_line for each stdout line as it arrives."""
    return host.stream(command(python, name, args), input=source(name), on_line=on_line, timeout=timeout,
                       env=env)


def parse_event(line: str, kinds: Sequence[str]) -> dict | None:
    """One stdout line of a streaming script as an event dict ({"event": KIND, ...} with KIND in
    `kinds`), or None for anything else (log lines, other JSON)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if isinstance(event, dict) and event.get("event") in kinds:
        return event
    return None


def stream_events(host: Host, python: str, name: str, args: Sequence[str], kinds: Sequence[str], *,
                  on_event: Callable[[dict], None] | None = None, timeout: float = 3600.0,
                  env: Mapping[str, str] | None = None) -> tuple[list[dict], Result]:
    """Run a script that speaks JSON-line events: each goes to on_event as it arrives; returns the
    events other than "progress" (plan, file, error, done...) and the Result."""
    events: list[dict] = []

    def on_line(line: str) -> None:
        event = parse_event(line, kinds)
        if event is None:
            return
        if event["event"] != "progress":
            events.append(event)
        if on_event is not None:
            on_event(event)

    return events, stream(host, python, name, args, on_line=on_line, timeout=timeout, env=env)
