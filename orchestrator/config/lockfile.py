"""An engine's hashed lock (`engine.lock_file`): the requirements file `uv pip compile
--generate-hashes` writes, every package the venv gets (the transitive ones too) pinned with the
sha256 of its files. Pure.

uv installs it with `--require-hashes` (host/remote/engine.py): a wheel whose bytes differ from the
lock (another upload under the same version on an index or mirror, a tampered wheelhouse) and a
package the lock does not list are refused before anything is installed. Only requirement lines
and their `--hash` options are read: any other option (`--index-url`, `--extra-index-url`,
`--find-links`, `-e`, `-r`, `-c`, ...) would choose where code comes from, and is refused.
"""

from __future__ import annotations

import re

from orchestrator.errors import ConfigError

MAX_BYTES = 8 << 20
NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?"
VERSION = r"[A-Za-z0-9][A-Za-z0-9.+!_-]{0,63}"
# name==version, or name @ https-URL; then an environment marker (uv pip compile --universal writes them)
REQUIREMENT = re.compile(rf"^(?P<name>{NAME})(?:\[[A-Za-z0-9_,.-]*\])?\s*"
                         rf"(?:==\s*(?P<version>{VERSION})|@\s*(?P<url>https://[^\s;#]+|file://[^\s;#]+))"
                         r"\s*(?:;\s*(?P<marker>[A-Za-z0-9_ .'\"<>=!(),~-]{1,400}?))?\s*$")
HASH = re.compile(r"^--hash=sha256:(?P<hex>[0-9a-f]{64})$")


def key(name: str) -> str:
    """A package name as PyPI normalizes it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each requirement: comments dropped, `\\` continuations joined."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip():
            out.append((start, buf.strip()))
        buf = ""
    if buf.strip():
        out.append((start, buf.strip()))
    return out


def parse(text: str, where: str) -> list[str]:
    """The lock's requirements, each one canonical line `name==version[ ; marker] --hash=sha256:...`
    (hashes sorted; `name @ URL` for a direct URL), sorted by name. ConfigError (at `where`:LINE)
    for anything else: an option, a requirement that is not pinned with `==`, one without a hash."""
    if len(text.encode()) > MAX_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_BYTES >> 20} MiB: not a lock file")
    out: dict[tuple[str, str], str] = {}
    for number, line in logical_lines(text):
        words = line.split()
        options = [w for w in words if w.startswith("-")]
        head = " ".join(w for w in words if not w.startswith("-"))
        if words[0].startswith("-"):
            raise ConfigError(f"{where}:{number}: {line[:80]!r}: a lock holds requirements and their hashes "
                              "only (an option here would choose where the code comes from)",
                              hint="write the lock with `uv pip compile --generate-hashes` and no index options "
                                   "(the host's uv gets its index from the inventory's env)")
        req = REQUIREMENT.match(head)
        if req is None:
            raise ConfigError(f"{where}:{number}: {head[:80]!r} is not pinned (name==version, or name @ https URL)",
                              hint="`uv pip compile --generate-hashes` pins every package")
        hashes = []
        for option in options:
            h = HASH.match(option)
            if h is None:
                raise ConfigError(f"{where}:{number}: {option[:60]!r}: only --hash=sha256:<64 hex> may follow "
                                  f"a requirement")
            hashes.append(option)
        if not hashes:
            raise ConfigError(f"{where}:{number}: {req['name']} has no --hash: every package of a lock needs one",
                              hint="write the lock with `uv pip compile --generate-hashes`")
        pin = f"=={req['version']}" if req["version"] else f" @ {req['url']}"
        marker = f" ; {req['marker'].strip()}" if req["marker"] else ""
        ident = (key(req["name"]), marker)
        if ident in out:
            raise ConfigError(f"{where}:{number}: {req['name']} is locked twice")
        out[ident] = f"{key(req['name'])}{pin}{marker} " + " ".join(sorted(set(hashes)))
    if not out:
        raise ConfigError(f"{where}: no requirements: not a lock file")
    return [out[k] for k in sorted(out)]


def pins(lines: list[str] | tuple[str, ...]) -> dict[str, str]:
    """name -> version (or `@ URL`) of each canonical line of `parse` (a marker's line counts too)."""
    out = {}
    for line in lines:
        head = requirement(line).split(" ; ", 1)[0]
        name, _, version = head.partition("==") if "==" in head else head.partition(" ")
        out[name] = version if "==" in head else version.strip()
    return out


def requirement(line: str) -> str:
    """A canonical line's requirement, without its hashes: what names a wheel (`vllm @ URL`)."""
    return line.split(" --hash=", 1)[0]
