"""Controller side of the engine venvs (orchestrator/host/remote/engine.py, run by the host's Python):
check one, build one (uploading the wheelhouse first for a host without registries), list them, and
the guarded removal gc uses.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.engine import Lock, allowed_wheel_url, offline_requirements
from orchestrator.config.inventory import HostEntry
from orchestrator.config.lockfile import requirement
from orchestrator.errors import CommandFailed, ConfigError, DeployFailed, RefusedError
from orchestrator.host import scripts
from orchestrator.host.base import Host, Script

SCRIPT = "engine.py"
EVENTS = ("step", "done", "error")
# Linux caps one argv word at 128 KiB (MAX_ARG_STRLEN, include/uapi/linux/binfmts.h), and the
# whole command is one word to the shell that runs it (`sh -c`): larger arguments go in a file.
ARGV_WORD_MAX = 64 << 10
WHEEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,250}\.whl$")


@dataclass(frozen=True)
class EngineState:
    """What the host says about one lock's venv: ok, missing, partial (a build cut short),
    mismatch (its marker names another lock) or broken (it does not verify), and why. An ok venv
    was `verified` "now" (the full check ran: `verify_seconds`, and `why_verified`: no verdict, a
    changed venv, --verify-engine) or "earlier" (the verdict recorded at `verified_at` by a check
    that passed, the venv unchanged since: only stats ran). `argcheck`: the parser's answer kept for
    the request the check was given, this very venv and argcheck.py (None: not kept; run it)."""

    lock: Lock
    path: str
    state: str
    detail: str = ""
    vllm_version: str | None = None
    bytes: int | None = None
    verified: str = ""
    verified_at: float | None = None
    verify_seconds: float | None = None
    why_verified: str = ""
    argcheck: dict | None = None

    @property
    def ok(self) -> bool:
        return self.state == "ok"


def wheelhouse_dir(entry: HostEntry) -> str:
    return f"{entry.engines_root}/.wheelhouse"


def _args(entry: HostEntry, lock: Lock, **more) -> str:
    """The engine script's request; `user`: the service user, as whom the venv's tools run (never root's
    code: host/remote/engine.py)."""
    return json.dumps({"root": entry.engines_root, "lock": lock.as_dict(), "user": entry.service_user, **more})


def _number(value: object) -> float | None:
    """A number the host's answer gave (JSON: NaN and Infinity parse too), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def argcheck_request(argv: Sequence[str], env: Mapping[str, str]) -> dict:
    """What argcheck.py is sent ({"argv", "env"}) plus the digest of the argcheck.py sent with it:
    the part of a kept parser answer's key the controller knows (the host adds the venv's)."""
    return {"argv": list(argv), "env": dict(env), "script": hashlib.sha256(scripts.source("argcheck.py")).hexdigest()}


def check(host: Host, entry: HostEntry, lock: Lock, *, force: bool = False,
          argcheck: Mapping | None = None) -> EngineState:
    """The lock's venv as the host has it. Trusts the verdict a passed verify recorded when nothing
    it fingerprints changed since (stats only); `force` (--verify-engine) verifies in full.
    `argcheck` (argcheck_request): also the parser's answer kept for it, if any (never with force)."""
    path = f"{entry.engines_root}/{lock.name}"
    more = {"argcheck": dict(argcheck)} if argcheck is not None and not force else {}
    answer, result = scripts.run_json(host, entry.python, SCRIPT, ["check", _args(entry, lock, force=force, **more)],
                                      timeout=900)
    if answer is None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no answer"]
        return EngineState(lock, path, "broken", f"the engine check did not answer: {tail[0][:300]}")
    size = answer.get("bytes")
    return EngineState(lock, path, str(answer.get("state")), str(answer.get("detail") or ""),
                       answer.get("vllm_version"), size if isinstance(size, int) else None,
                       verified=str(answer.get("verified") or ""), verified_at=_number(answer.get("verified_at")),
                       verify_seconds=_number(answer.get("verify_seconds")),
                       why_verified=str(answer.get("why_verified") or ""), argcheck=kept_answer(answer.get("argcheck")))


def kept_answer(value: object) -> dict | None:
    """A kept parser answer as the host returned it (untrusted): one that passed, else None (run it)."""
    return value if isinstance(value, dict) and value.get("ok") is True else None


def remember_argcheck(host: Host, entry: HostEntry, lock: Lock, request: Mapping, answer: Mapping) -> bool:
    """Keep a parser answer that passed beside the venv's verdict (host/remote/engine.py `remember`:
    only while the verdict is trusted). False when it was not kept: the next check runs the parser."""
    if answer.get("ok") is not True:
        return False
    text = _args(entry, lock, argcheck=dict(request), answer=dict(answer))
    argv = ["remember", text]
    if len(text.encode()) > ARGV_WORD_MAX:
        path = f"{entry.engines_root}/.args-{secrets.token_hex(16)}.json"     # the script reads and deletes it
        try:
            host.put(path, text.encode(), 0o600)
        except (CommandFailed, OSError):
            return False
        argv = ["remember", "--args-file", path]
    kept, _ = scripts.run_json(host, entry.python, SCRIPT, argv, timeout=60)
    return bool(kept and kept.get("recorded") is True)


def listing(host: Host, entry: HostEntry) -> dict:
    """{"engines": [{"name", "complete", "vllm_version", "bytes"}], "wheelhouse": {file: size}}."""
    answer, result = scripts.run_json(host, entry.python, SCRIPT, ["list", json.dumps({"root": entry.engines_root})],
                                      timeout=120)
    if answer is None:
        raise DeployFailed("the engine listing did not answer", host=entry.name, step="engines",
                           details=(result.stderr or result.stdout).strip().splitlines()[-3:])
    return answer


def remove_command(entry: HostEntry, name: str) -> Script:
    """The guarded removal of one engine venv (a folder named like one, under engines_root, no link)."""
    return scripts.command(entry.python, SCRIPT, ["remove", json.dumps({"root": entry.engines_root, "name": name})])


def remove(host: Host, entry: HostEntry, name: str) -> str | None:
    """Remove one engine venv through the guarded removal: None when removed, else why not."""
    answer, result = scripts.run_json(host, entry.python, SCRIPT,
                                      ["remove", json.dumps({"root": entry.engines_root, "name": name})], timeout=600)
    if answer is not None and answer.get("removed"):
        return None
    return str((answer or {}).get("why") or (result.stderr.strip().splitlines() or [f"exit {result.exit_code}"])[-1])


def local_wheels(folder: str) -> dict[str, Path]:
    """The wheels of the controller's wheelhouse (file names a wheel can have, regular files)."""
    out = {}
    try:
        found = sorted(Path(folder).expanduser().iterdir())
    except OSError as exc:
        raise ConfigError(f"the inventory's wheelhouse {folder} cannot be read on this machine: "
                          f"{exc.strerror or exc}", hint="wheelhouse is a folder of wheels on the controller "
                          "(where vllm-orch runs): the engine step uploads them to the host") from None
    for p in found:
        if WHEEL.match(p.name) and p.is_file() and not p.is_symlink():
            out[p.name] = p
    return out


def upload_wheelhouse(host: Host, entry: HostEntry, on_step: Callable[[str], None] | None = None) -> int:
    """Put the controller's wheelhouse (inventory `wheelhouse`) into engines_root/.wheelhouse: the
    wheels the host lacks or holds at another size. Returns the bytes sent."""
    have = listing(host, entry).get("wheelhouse", {})
    sent = 0
    for name, path in local_wheels(entry.wheelhouse).items():
        size = path.stat().st_size
        if have.get(name) == size:
            continue
        host.put_file(f"{wheelhouse_dir(entry)}/{name}", path, 0o644)     # streamed: wheels are GBs
        sent += size
        if on_step:
            on_step(f"uploaded {name}")
    return sent


def build_args(entry: HostEntry, lock: Lock) -> list[str]:
    """The engine script's arguments for building the lock's venv (what the plan shows is what runs).
    ConfigError for a wheel URL outside the host's wheel_url_prefixes (config/engine.py)."""
    for line in lock.requirements:
        if line.startswith("vllm @ "):
            allowed_wheel_url(requirement(line).removeprefix("vllm @ "), entry)
    if not entry.wheelhouse:
        return ["build", _args(entry, lock, uv=entry.uv, wheelhouse=None)]
    house = wheelhouse_dir(entry)
    urls = any(r.startswith("vllm @ ") for r in lock.requirements)
    install = offline_requirements(lock, local_wheels(entry.wheelhouse) if urls else (), house, entry.wheelhouse)
    return ["build", _args(entry, lock, uv=entry.uv, wheelhouse=house, install=list(install))]


def build(host: Host, entry: HostEntry, lock: Lock, *, on_event: Callable[[dict], None] | None = None,
          timeout: float = 4 * 3600.0) -> dict:
    """Build (and verify) the lock's venv on the host; the wheelhouse first when the host has one.
    Returns the done event plus "uploaded_bytes" and "seconds" (the whole step's)."""
    started = time.monotonic()
    uploaded = 0
    if entry.wheelhouse:
        uploaded = upload_wheelhouse(host, entry, (lambda s: on_event({"event": "step", "what": s}))
                                     if on_event else None)
    events, result = scripts.stream_events(host, entry.python, SCRIPT, build_args(entry, lock), EVENTS,
                                           on_event=on_event, timeout=timeout)
    errors = [e for e in events if e["event"] == "error"]
    if errors:
        message = str(errors[0].get("message", ""))
        if "symlink" in message or "not a folder vllm-orch built" in message:
            raise RefusedError(f"engine venv refused: {message}", host=entry.name, step="engine")
        no_uv = f"No such file or directory: '{entry.uv}'" in message
        hint = "the host's uv must reach the registries (the inventory's env, e.g. UV_INDEX_URL), or set " \
               "`wheelhouse` for it to build offline"
        if no_uv:
            hint = (f"the host has no uv at the inventory's `uv` ({entry.uv}): install uv "
                    f"(https://docs.astral.sh/uv/) or set `uv:` to its path")
        elif "Hash mismatch" in message:                            # uv's words under --require-hashes
            hint = ("a wheel's bytes differ from the engine's lock_file: the index, mirror or wheelhouse serves "
                    "another file under that version than the lock was compiled from; nothing was installed")
        elif "no trusted hash was provided" in message:
            hint = ("the engine's lock_file lacks a package the install needs (a dependency): compile the lock "
                    "for the host's Python and platform (uv pip compile --generate-hashes --python-version ... "
                    "--python-platform ...)")
        elif "building from source is disabled" in message:      # uv's words for --no-build
            hint = ("engines install wheels only (uv --no-build: no package's setup.py runs on the host): "
                    "pin a version that has a wheel, or put its wheel into the wheelhouse")
        raise DeployFailed(f"engine venv {lock.name} did not build: {message}", host=entry.name, step="engine",
                           hint=hint)
    done = [e for e in events if e["event"] == "done"]
    if result.exit_code != 0 or not done:
        raise DeployFailed(f"the engine build exited {result.exit_code}", host=entry.name, step="engine",
                           details=(result.stderr or "").strip().splitlines()[-5:])
    return {**done[0], "uploaded_bytes": uploaded, "seconds": round(time.monotonic() - started, 2)}
