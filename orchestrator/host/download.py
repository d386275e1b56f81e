"""Controller side of the Download step: run orchestrator/host/remote/download.py with the HOST's Python
and turn its JSON lines into a plan and a result (its progress bar: ops/progress.py).

Transport: orchestrator/host/scripts.py (`python - ARGS`, the script on stdin), streamed so that
progress arrives as the bytes do. The HF token never appears in argv or in the shell text: given
as a Secret it is put into a 0600 file under `<state_dir>/secrets/` for the run, which the script
removes as soon as it has read it (or pass an existing `token_file`, never removed, or rely on
HF_TOKEN already set in the host's environment).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from orchestrator.config.inventory import HostEntry
from orchestrator.errors import DeployFailed, RefusedError
from orchestrator.host import scripts
from orchestrator.host.base import Host, Script
from orchestrator.secret import Secret

SCRIPT = "download.py"
EVENTS = ("plan", "progress", "file", "error", "done")
HINTS = {
    "auth": "set HF_TOKEN for the host (or a token file) and make sure the account has access to the repo",
    "not_found": "check source.repo and source.revision in the manifest",
    "network": "run the deploy again: the download resumes where it stopped",
    "checksum": "run the deploy again; if a shard keeps failing, the hub (or a proxy) serves bad data",
    "disk": "free space under models_root or fix its permissions",
    "unsafe": "the Hub (or the mirror in HF_ENDPOINT) lists file names that point outside the model folder, "
              "or someone planted a symlink in it: check the repo and the host's HF_ENDPOINT",
}


def download_args(repo: str, revision: str, local_dir: str, *, allow: Iterable[str] = (),
                  ignore: Iterable[str] = (), workers: int = 8, plan_only: bool = False,
                  token_file: str | None = None, extra: Iterable[str] = (), remove_token_file: bool = False,
                  commit: str | None = None) -> list[str]:
    """The download script's arguments (orchestrator/host/remote/download.py); `commit`: exactly the
    commit the plan resolved `revision` to (a branch can move between a plan and its apply)."""
    argv = ["--repo", repo, "--revision", revision, "--local-dir", local_dir, "--workers", str(workers)]
    if commit:
        argv += ["--commit", commit]
    for p in allow:
        argv += ["--allow", p]
    for p in ignore:
        argv += ["--ignore", p]
    if token_file:
        argv += ["--token-file", token_file] + (["--remove-token-file"] if remove_token_file else [])
    if plan_only:
        argv.append("--plan-only")
    return argv + list(extra)


def failure(host: Host, event: dict, stderr: str = "") -> DeployFailed | RefusedError:
    kind = event.get("kind", "network")
    details = [ln for ln in stderr.strip().splitlines()[-5:] if ln]
    if kind == "unsafe":       # nothing was written: a safety refusal (exit 3), not a failed download
        return RefusedError(f"download refused: {event.get('message', '')}", hint=HINTS[kind], host=host.name,
                            step="download", details=details)
    return DeployFailed(f"download failed ({kind}): {event.get('message', '')}", hint=HINTS.get(kind),
                        host=host.name, step="download", details=details)


# A token file older than this was left by a run cut between its upload and the script's start (the
# script removes the file it was given as soon as it has read it): the next run sweeps it.
STALE_TOKEN_MIN = 60


class _TokenFile:
    """A Secret token as a 0600 file on the host for one run: the download script removes it once
    read (a connection that drops later cannot leave it behind); the end of the run removes it in
    case the script never started, and sweeps stale ones."""

    def __init__(self, host: Host, state_dir: str, token: Secret | None, token_file: str | None,
                 prefix: str = "hf-token"):
        self.host, self.token, self.prefix = host, token, prefix
        self.path = token_file
        self.created: str | None = None          # the file this run wrote (and removes)
        if token:
            self.created = self.path = f"{state_dir.rstrip('/')}/secrets/{prefix}-{time.time_ns()}"

    def __enter__(self) -> str | None:
        if self.created and self.token:
            self.host.put(self.created, self.token.reveal().encode(), 0o600)
        return self.path

    def __exit__(self, *exc) -> None:
        if self.created:
            folder = shlex.quote(os.path.dirname(self.created))
            self.host.run(Script(f"rm -f {shlex.quote(self.created)}; find {folder} -maxdepth 1 -type f -name "
                                 f"{shlex.quote(self.prefix + '-*')} -mmin +{STALE_TOKEN_MIN} -delete 2>/dev/null; "
                                 f"true"), timeout=30)


def _run_script(host: Host, python: str, repo: str, revision: str, local_dir: str, allow, ignore,
                env, *, state_dir: str, token, token_file, workers: int, plan_only: bool,
                extra: Iterable[str], timeout: float, on_event: Callable[[dict], None] | None,
                commit: str | None = None, peer: Peer | None = None):
    with _TokenFile(host, state_dir, token, token_file) as tf, \
            _TokenFile(host, state_dir, peer.token if peer else None, None, "peer-token") as ptf:
        if peer is not None:
            extra = [*extra, "--peer", peer.url, "--peer-token-file", str(ptf)]
        args = download_args(repo, revision, local_dir, allow=allow, ignore=ignore, workers=workers,
                             plan_only=plan_only, token_file=tf, extra=extra, remove_token_file=bool(token),
                             commit=commit)
        events, result = scripts.stream_events(host, python, SCRIPT, args, EVENTS, on_event=on_event,
                                               timeout=timeout, env=env)
    errors = [e for e in events if e["event"] == "error"]
    if errors:
        raise failure(host, errors[0], result.stderr)
    if result.exit_code != 0:
        raise DeployFailed(f"download script exited {result.exit_code}", host=host.name, step="download",
                           hint="is huggingface_hub installed in the host's Python?",
                           details=result.stderr.strip().splitlines()[-5:])
    return events, result


@dataclass(frozen=True)
class Peer:
    """A fleet host serving a verified folder to the others (serve_weights.py): its inventory name,
    the URL the others reach it at, the token it wants."""

    host: str
    url: str
    token: Secret


SERVE_SCRIPT = "serve_weights.py"


class Serving:
    """serve_weights.py running on a host for one folder: the Peer to hand the others; `close` ends
    it (its stdin closes; a dropped connection ends it too)."""

    def __init__(self, host: Host, entry: HostEntry, folder: str, address: str, rate_bps: int = 0):
        token = Secret(secrets.token_urlsafe(32))
        run_dir = f"{entry.state_dir.rstrip('/')}/fleet"            # the script root runs: root's alone
        script = f"{run_dir}/{SERVE_SCRIPT}"
        host.run(Script(f"mkdir -p {shlex.quote(run_dir)} && [ ! -L {shlex.quote(run_dir)} ] && "
                        f"chmod 0700 {shlex.quote(run_dir)}"), timeout=30).check(entry.name, "make state_dir/fleet")
        host.put(script, scripts.source(SERVE_SCRIPT), 0o700)
        with _TokenFile(host, entry.state_dir, token, None, "peer-token") as tf:
            request = json.dumps({"dir": folder, "bind": address, "token_file": tf, "rate_bps": rate_bps})
            self.proc = host.spawn([entry.python, script, request])
            event, line, deadline = None, None, time.monotonic() + 60.0
            while event is None and time.monotonic() < deadline:      # a warning may come first
                line = self.proc.readline(max(0.1, deadline - time.monotonic()))
                if line is None:
                    break
                event = scripts.parse_event(line, ("listening", "error"))
        if event is None or event["event"] != "listening":
            self.proc.close()
            why = (event or {}).get("message") or f"no answer ({(line or '')[:80]!r})"
            raise DeployFailed(f"{entry.name} cannot serve {folder} to the fleet: {why}", host=entry.name,
                               step="download")
        host_part = f"[{address}]" if ":" in address else address
        self.peer = Peer(entry.name, f"http://{host_part}:{int(event['port'])}", token)

    def close(self) -> None:
        self.proc.close()


def plan_download(host: Host, python: str, repo: str, revision: str, local_dir: str,
                  allow: Iterable[str] = (), ignore: Iterable[str] = (), env: Mapping[str, str] | None = None,
                  *, state_dir: str = "/tmp", token: Secret | None = None, token_file: str | None = None,
                  extra: Iterable[str] = (), timeout: float = 120.0) -> dict:
    """The plan event: files, total_bytes, have_bytes (present AND in our record), to_fetch_bytes,
    partial_bytes (resumable), to_fetch [names], commit. Reads no file content on the host."""
    events, _ = _run_script(host, python, repo, revision, local_dir, allow, ignore, env, state_dir=state_dir,
                            token=token, token_file=token_file, workers=1, plan_only=True, extra=extra,
                            timeout=timeout, on_event=None)
    plans = [e for e in events if e["event"] == "plan"]
    if not plans:
        raise DeployFailed("the download script printed no plan", host=host.name, step="download")
    return plans[0]


def run_download(host: Host, python: str, repo: str, revision: str, local_dir: str,
                 allow: Iterable[str] = (), ignore: Iterable[str] = (), env: Mapping[str, str] | None = None,
                 *, on_event: Callable[[dict], None] | None = None, workers: int = 8, state_dir: str = "/tmp",
                 token: Secret | None = None, token_file: str | None = None, extra: Iterable[str] = (),
                 timeout: float = 24 * 3600.0, commit: str | None = None, peer: Peer | None = None) -> dict:
    """Download and verify (exactly `commit` of `revision` when given: the plan's); returns {"plan",
    "done", "files": [file events], "seconds"}. Raises DeployFailed (step "download", with a hint per
    error kind) on any error event."""
    started = time.monotonic()
    events, _ = _run_script(host, python, repo, revision, local_dir, allow, ignore, env, state_dir=state_dir,
                            token=token, token_file=token_file, workers=workers, plan_only=False, extra=extra,
                            timeout=timeout, on_event=on_event, commit=commit, peer=peer)
    done = [e for e in events if e["event"] == "done"]
    if not done or not done[0].get("verified"):
        raise DeployFailed("the download script ended without a verified result", host=host.name,
                           step="download", hint=HINTS["network"])
    return {"plan": next((e for e in events if e["event"] == "plan"), None), "done": done[0],
            "files": [e for e in events if e["event"] == "file"], "seconds": time.monotonic() - started}
