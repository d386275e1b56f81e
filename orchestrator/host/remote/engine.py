"""Host-side engine venvs (a manifest's `engine:`): check one, build one, list them, remove one.

Run by the host's Python (>= 3.8, stdlib only) as `python - MODE '<json>'` (orchestrator/host/engine.py),
or `python - MODE --args-file PATH` for arguments too large for one argv word (read, then deleted).

    check   {"root", "lock", "user", "force", "argcheck"} -> {"state": ok|missing|partial|mismatch|broken,
                                                     "verified": earlier|now, "argcheck": answer|null, ...}
    remember {"root", "lock", "argcheck", "answer"} -> {"recorded": bool, "why"}
    build   {"root", "lock", "user", "uv", "wheelhouse"} -> JSON-line events: step ..., then done or error
    list    {"root"}                             -> {"engines": [{"name", "lock", "bytes", "complete"}],
                                                     "wheelhouse": {file: size}}
    remove  {"root", "name"}                     -> {"removed": bool, "why"}

A venv is `<root>/<lock name>` (vllm-<version>-<hash>). It counts as built only when its marker
(vllm-orch-engine.json, written LAST) names the lock whose hash is its name's, and it verifies: every
pinned distribution at its pinned version, `import vllm` (and torch, flashinfer when pinned), and
`vllm --version` printing the lock's version (tens of seconds of CPU on a real vLLM: each imports it).

A verify that passed records its verdict beside the marker (vllm-orch-verified.json, the running
user's, 0644): the lock hash, the vLLM version, the Python, and the fingerprint of what could change
the verdict (the stat of the marker, pyvenv.cfg, bin/vllm, the Python bin/python resolves to and its
path, site-packages, the `vllm` package folder, every pinned distribution's dist-info folder). A
later check whose fingerprint matches trusts the verdict and imports nothing (stats and one listing);
any difference, or a verdict file that is missing, does not parse or is not a regular file of the
running user's without group or other write, means the full verify again (`force` too). A verify
that fails removes the verdict.

The parser's answers are kept beside the verdict (vllm-orch-argcheck.json, the same trust rule):
argcheck.py imports vLLM (seconds on a CPU build, tens on a GPU host) to parse the service's argv,
and its answer depends only on that argv and env, the script itself, and the venv. `remember` keeps
an answer that passed, under the key `argcheck_key` makes of all of them (the request's argv, env
and argcheck.py's digest, the Python the venv runs, the lock hash and the venv's fingerprint), and
only while the venv's verdict is trusted; a `check` of an ok venv (not `force`) given the same
request returns it as "argcheck". A venv rebuilt at the same path has another fingerprint (its
marker's inode and times), so an answer copied across, or left by a build that was removed, is
never found; a file that is garbled or not ours is an answer not found, never an error.

A folder without the marker is a build that was cut short: the next build removes it and starts
again (a venv cannot be moved once built, so it is built in place). uv installs wheels only
(`--no-build`): an sdist is refused, never built, so no package's setup.py or build backend runs.

Root runs this script, and nothing of the venv's (`user`, the service user, when root runs it):
root makes the venv's folder and hands it, uv's cache (`.uv-cache`) and the Pythons uv installs
(`.python`) to the user; uv (`uv venv`, `uv pip install`) runs as that user, so a hostile wheel's
paths can write only where the user may; then root takes everything back (root's, read-only to
others: dirs 0755, files without group or other write: the service user runs the venv but cannot
change it) and only then runs the verify, as the user again: the venv's Python, `vllm --version`
and every `.pth` file a package installed (which `python -I` does not stop) run with the service
user's rights, never root's. Root writes the marker and the verdict itself, from their answers.
Without root (a process host of one user) nothing switches: everything runs as that user.
"""

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time

MARKER = "vllm-orch-engine.json"
VERDICT = "vllm-orch-verified.json"
VERDICT_MAX = 1 << 16
ARGCHECK = "vllm-orch-argcheck.json"
ARGCHECK_MAX = 1 << 20
FALLBACK_USER = "nobody"  # the venv's tools' user before the service user exists (never root)
ARGCHECK_KEEP = 16        # answers kept per venv (the services that share it, a few edits back)
NAME = re.compile(r"^vllm-[0-9][A-Za-z0-9.+]{0,60}-[0-9a-f]{16}$")
WHEEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,250}\.whl$")


def emit(event, **fields):
    fields["event"] = event
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def lock_hash(lock):
    text = json.dumps({"python": lock["python"], "requirements": list(lock["requirements"])},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def safe_dir(root, name):
    """<root>/<name> when name is an engine venv's name and the path is a real folder (no link)."""
    if not NAME.match(name or ""):
        return None
    path = os.path.join(root, name)
    return path if os.path.isdir(path) and not os.path.islink(path) else None


def dir_bytes(path):
    total = 0
    for top, dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_blocks * 512
            except OSError:
                pass
    return total


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


VERIFY = r"""
import json, sys
from importlib import metadata
pins, mods = json.loads(sys.argv[1])
out = {"versions": {}, "imports": {}}
for name, want in pins:
    try:
        out["versions"][name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out["versions"][name] = None
for mod in mods:
    try:
        __import__(mod)
        out["imports"][mod] = None
    except BaseException as exc:
        out["imports"][mod] = "%s: %s" % (type(exc).__name__, str(exc)[:300])
print(json.dumps(out))
"""


def same_version(have, want):
    if have is None:
        return False
    return have == want or have.split("+")[0] == want or have.replace("+", "%2B") == want


def user_of(args):
    """The service user the venv's tools run as ({"uid", "gid", "name", "home"}; `nobody` while the
    host lacks it), or None: this script does not run as root (it cannot switch users, and
    everything is that user's already), or the service user is root (the service runs as root)."""
    name = args.get("user")
    if os.geteuid() != 0 or not name or name == "root":
        return None
    import pwd
    try:
        pw = pwd.getpwnam(name)
    except KeyError:            # not made yet (the plan's user step makes it): never root meanwhile
        try:
            pw = pwd.getpwnam(FALLBACK_USER)
        except KeyError:
            raise RuntimeError("neither the service user %r nor %s exists on this host: the venv's tools "
                               "run as an unprivileged user" % (name, FALLBACK_USER))
        name = FALLBACK_USER
    if pw.pw_uid == 0:
        raise RuntimeError("the service user %r has uid 0: the venv's tools run as an unprivileged user" % name)
    return {"uid": pw.pw_uid, "gid": pw.pw_gid, "name": name, "home": pw.pw_dir or "/"}


def as_user(user):
    """subprocess's preexec_fn that drops to `user` (its groups, gid, then uid), or None (no switch)."""
    if user is None:
        return None

    def drop():
        os.initgroups(user["name"], user["gid"])
        os.setgid(user["gid"])
        os.setuid(user["uid"])
        os.chdir("/")
    return drop


def user_env(env, user):
    """env with HOME, USER and LOGNAME of the user a tool runs as."""
    if user is not None:
        env = dict(env, HOME=user["home"], USER=user["name"], LOGNAME=user["name"])
    return env


def hand_over(path, user):
    """Make the folder at path (created when missing) and everything in it the user's, for a build
    step the user runs; no links followed. Nothing when no user is switched to."""
    os.makedirs(path, mode=0o755, exist_ok=True)
    if user is None:
        return
    if os.path.islink(path):
        raise RuntimeError("%s is a symlink: vllm-orch builds engines only in folders of its own" % path)
    for name in every_path(path):
        os.lchown(name, user["uid"], user["gid"])


def every_path(path):
    """path and everything under it (os.walk: links listed, never followed)."""
    for top, dirs, files in os.walk(path):
        yield top
        for name in dirs + files:
            yield os.path.join(top, name)


def isolated(**more):
    """This script's environment for a venv's tools, without PYTHONPATH / PYTHONHOME: an engine
    venv holds its own pinned packages, and a path put before them would shadow them (the
    flashinfer pair checked from another folder's copies)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(more)
    return env


def verify(venv, lock, user):
    """(None, vllm version) when the venv holds the lock and runs, else (why, None). The pins and
    imports, and `vllm --version`, run side by side (each imports vLLM: seconds on a real one), as
    `user` (user_of) when there is one: never root's code."""
    py, vllm = os.path.join(venv, "bin", "python"), os.path.join(venv, "bin", "vllm")
    pins = [p for p in lock.get("pins", [])]
    names = set(n for n, _ in pins)
    mods = ["vllm"] + (["torch"] if "torch" in names else []) + \
        (["flashinfer"] if "flashinfer-python" in names else [])
    env = user_env(isolated(VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu")), user)
    try:
        probe = subprocess.Popen([py, "-I", "-c", VERIFY, json.dumps([pins, mods])], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=user_env(isolated(), user), preexec_fn=as_user(user))
    except OSError as exc:
        return "%s does not run: %s" % (py, exc), None
    try:
        version_run = subprocess.Popen([vllm, "--version"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                       preexec_fn=as_user(user))
    except OSError as exc:
        probe.kill()
        probe.wait()
        return "vllm --version: %s" % exc, None
    try:
        out, err = probe.communicate(timeout=600)
        vout, _ = version_run.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        for p in (probe, version_run):
            p.kill()
            p.wait()
        return "the venv's checks took more than 600 s", None
    try:
        found = json.loads(out.decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return "the venv's Python failed: %s" % err.decode(errors="replace").strip()[-300:], None
    for name, want in pins:
        have = found["versions"].get(name)
        if not same_version(have, want):
            return "%s is %s, the lock pins %s" % (name, have or "not installed", want), None
    for mod, error in found["imports"].items():
        if error:
            return "import %s failed: %s" % (mod, error), None
    lines = vout.decode(errors="replace").strip().splitlines()
    version = lines[-1].strip() if lines else ""
    if version_run.returncode != 0 or not same_version(version, lock["vllm_version"]):
        return "vllm --version printed %r (exit %d), the lock pins %s" % (
            version[:80], version_run.returncode, lock["vllm_version"]), None
    return None, version


def site_packages(venv):
    """<venv>/lib/pythonX.Y/site-packages, or None."""
    lib = os.path.join(venv, "lib")
    try:
        names = sorted(os.listdir(lib))
    except OSError:
        return None
    for name in names:
        path = os.path.join(lib, name, "site-packages")
        if name.startswith("python") and os.path.isdir(path):
            return path
    return None


def stat_of(path):
    """What a change to the file or folder at path changes (its stat, through links), None if absent.
    A folder's mtime and ctime change when an entry is added, removed or renamed (a reinstall); ctime
    cannot be set back by hand."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid]


def fingerprint(venv, lock):
    """The stats of what could change the venv's verdict: a reinstall or removal of vLLM or a pinned
    package, a change of the Python the venv runs, a rebuild. Stats and one listing; nothing runs."""
    py = os.path.join(venv, "bin", "python")
    out = {name: stat_of(os.path.join(venv, name)) for name in (MARKER, "pyvenv.cfg", "bin/vllm")}
    out["python"] = [os.path.realpath(py), stat_of(os.path.realpath(py))]
    sp = site_packages(venv)
    out["site-packages"] = [sp, stat_of(sp) if sp else None, stat_of(os.path.join(sp, "vllm")) if sp else None]
    pinned = set(norm(name) for name, _ in lock.get("pins", []))
    dists = {}
    try:
        names = sorted(os.listdir(sp)) if sp else []
    except OSError:
        names = []
    for name in names:
        if name.endswith(".dist-info") and norm(name[:-len(".dist-info")].rsplit("-", 1)[0]) in pinned:
            dists[name] = stat_of(os.path.join(sp, name))
    out["dist-info"] = dists
    return json.loads(json.dumps(out))          # as it reads back from the verdict file


def read_own(path, limit, what):
    """(the JSON of a file this user wrote, "") when it is a regular file of the running user's
    without group or other write, at most `limit` bytes, and parses; else (None, why)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None, "no %s recorded" % what
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022 \
                or st.st_size > limit:
            return None, "the %s file is not one vllm-orch wrote (type, owner or mode)" % what
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        return None, "the %s file could not be read: %s" % (what, exc)
    finally:
        os.close(fd)
    try:
        return json.loads(data.decode()), ""
    except ValueError:
        return None, "the %s file does not parse" % what


def write_own(venv, name, value):
    """Write venv/name whole (0644, the running user's), then move it in place. False on failure."""
    tmp = os.path.join(venv, "%s.%d.tmp" % (name, os.getpid()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            json.dump(value, f)
        os.replace(tmp, os.path.join(venv, name))
        return True
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
        return False


def read_verdict(venv, lock):
    """(the recorded verdict, "") when it is trustworthy and the venv is unchanged since; else (None, why)."""
    verdict, why = read_own(os.path.join(venv, VERDICT), VERDICT_MAX, "verdict")
    if why:
        return None, why
    if not isinstance(verdict, dict) or verdict.get("hash") != lock["hash"] or \
            not isinstance(verdict.get("vllm_version"), str) or \
            not same_version(verdict["vllm_version"], lock["vllm_version"]):
        return None, "the verdict file is not this lock's"
    if verdict.get("fingerprint") != fingerprint(venv, lock):
        return None, "the venv changed since it was verified"
    return verdict, ""


def record_verdict(venv, lock, version, seconds):
    """Write the verdict of a verify that passed (written whole, then moved in place). False when
    it could not be written (the check still counts: the next one verifies again)."""
    verdict = {"hash": lock["hash"], "vllm_version": version, "python": os.path.realpath(
        os.path.join(venv, "bin", "python")), "fingerprint": fingerprint(venv, lock), "verified_at": time.time(),
        "seconds": seconds}
    return write_own(venv, VERDICT, verdict)


def forget_verdict(venv):
    for name in (VERDICT, ARGCHECK):
        try:
            os.remove(os.path.join(venv, name))
        except OSError:
            pass


def argcheck_key(venv, lock, request):
    """The key of a parser answer: everything it depends on. request: {"argv", "env", "script"}
    (script: the digest of the argcheck.py the controller sends)."""
    if not isinstance(request, dict):
        return None
    text = json.dumps({"argv": request.get("argv"), "env": request.get("env"), "script": request.get("script"),
                       "python": os.path.realpath(os.path.join(venv, "bin", "python")), "lock": lock["hash"],
                       "fingerprint": fingerprint(venv, lock)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def argcheck_answers(venv):
    """{key: {"answer", "at"}} of the answers kept (none when the file is missing, garbled or not ours)."""
    kept, _why = read_own(os.path.join(venv, ARGCHECK), ARGCHECK_MAX, "argcheck")
    entries = kept.get("answers") if isinstance(kept, dict) else None
    if not isinstance(entries, dict):
        return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict) and isinstance(v.get("answer"), dict)
            and isinstance(v.get("at"), (int, float))}


def argcheck_answer(venv, lock, request):
    """The parser's answer kept for exactly this request and venv, else None."""
    key = argcheck_key(venv, lock, request)
    entry = argcheck_answers(venv).get(key) if key else None
    answer = entry["answer"] if entry else None
    return answer if answer is not None and answer.get("ok") is True else None


def remember(args):
    """Keep a parser answer that passed, for a venv whose verdict is trusted now (so its fingerprint
    is that of a venv that verified)."""
    root, lock, request, answer = args["root"], args["lock"], args.get("argcheck"), args.get("answer")
    if lock_hash(lock) != lock["hash"] or not lock["name"].endswith("-" + lock["hash"]):
        return {"recorded": False, "why": "the lock's hash does not match its content"}
    venv = safe_dir(root, lock["name"])
    if venv is None:
        return {"recorded": False, "why": "no venv %s" % lock["name"]}
    if not isinstance(answer, dict) or answer.get("ok") is not True:
        return {"recorded": False, "why": "only an answer that passed is kept"}
    verdict, why = read_verdict(venv, lock)
    if verdict is None:
        return {"recorded": False, "why": why}
    key = argcheck_key(venv, lock, request)
    if key is None:
        return {"recorded": False, "why": "the request is not an object"}
    entries = argcheck_answers(venv)
    entries[key] = {"answer": answer, "at": time.time()}
    newest = sorted(entries, key=lambda k: entries[k]["at"], reverse=True)[:ARGCHECK_KEEP]
    kept = {"answers": {k: entries[k] for k in newest}}
    if len(json.dumps(kept)) > ARGCHECK_MAX:
        kept = {"answers": {key: entries[key]}}
        if len(json.dumps(kept)) > ARGCHECK_MAX:
            return {"recorded": False, "why": "the answer is too large to keep"}
    return {"recorded": write_own(venv, ARGCHECK, kept)}


def check(args):
    root, lock = args["root"], args["lock"]
    if lock_hash(lock) != lock["hash"] or not lock["name"].endswith("-" + lock["hash"]):
        return {"state": "mismatch", "detail": "the lock's hash does not match its content"}
    venv = os.path.join(root, lock["name"])
    if os.path.islink(venv) or (os.path.exists(venv) and not os.path.isdir(venv)):
        return {"state": "broken", "detail": "%s is not a folder vllm-orch built" % venv}
    if not os.path.isdir(venv):
        return {"state": "missing", "detail": "%s does not exist" % venv}
    marker = read_json(os.path.join(venv, MARKER))
    if marker is None:
        return {"state": "partial", "detail": "%s has no %s: a build that did not finish" % (venv, MARKER)}
    if not isinstance(marker, dict) or marker.get("hash") != lock["hash"] or \
            lock_hash(marker.get("lock") or {"python": "", "requirements": []}) != lock["hash"]:
        return {"state": "mismatch", "detail": "%s/%s names another lock" % (venv, MARKER)}
    why_full = "--verify-engine"
    if not args.get("force"):
        verdict, why_full = read_verdict(venv, lock)
        if verdict is not None:
            return {"state": "ok", "vllm_version": verdict["vllm_version"], "bytes": marker.get("bytes"),
                    "built_seconds": marker.get("seconds"), "verified": "earlier",
                    "verified_at": verdict.get("verified_at"), "verify_seconds": verdict.get("seconds"),
                    "argcheck": argcheck_answer(venv, lock, args.get("argcheck"))}
    started = time.monotonic()
    try:
        why, version = verify(venv, lock, user_of(args))
    except RuntimeError as exc:
        return {"state": "broken", "detail": str(exc)}
    if why:
        forget_verdict(venv)
        return {"state": "broken", "detail": why}
    seconds = round(time.monotonic() - started, 2)
    recorded = record_verdict(venv, lock, version, seconds)
    return {"state": "ok", "vllm_version": version, "bytes": marker.get("bytes"),
            "built_seconds": marker.get("seconds"), "verified": "now", "verify_seconds": seconds,
            "why_verified": why_full, "recorded": recorded,
            "argcheck": None if args.get("force") else argcheck_answer(venv, lock, args.get("argcheck"))}


def run(argv, env, what, user=None):
    emit("step", what=what, argv=argv, **({"user": user["name"]} if user else {}))
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=user_env(env, user),
                       preexec_fn=as_user(user))
    if r.returncode != 0:
        tail = r.stdout.decode(errors="replace").strip().splitlines()[-8:]
        raise RuntimeError("%s failed (exit %d): %s" % (what, r.returncode, " | ".join(tail)))


def lock_down(path):
    """Root's and read-only to everyone else: dirs 0755 (files keep their x bits), no group/other write."""
    uid = os.geteuid()
    for name in every_path(path):
        st = os.lstat(name)
        if uid == 0 and (st.st_uid != 0 or st.st_gid != 0):
            os.lchown(name, 0, 0)
        if not os.path.islink(name) and st.st_mode & 0o022:
            os.chmod(name, st.st_mode & ~0o022)


def build(args):
    root, lock, uv = args["root"], args["lock"], args["uv"]
    wheelhouse = args.get("wheelhouse")
    started = time.monotonic()
    state = check(args)
    if state["state"] == "ok":
        emit("done", seconds=0.0, built=False, **state)
        return 0
    if state["state"] in ("mismatch", "broken") and "not a folder" in state.get("detail", ""):
        emit("error", message=state["detail"])
        return 1
    os.makedirs(root, mode=0o755, exist_ok=True)
    if os.path.islink(root):
        emit("error", message="%s is a symlink: vllm-orch builds engines only in a folder of its own" % root)
        return 1
    venv = os.path.join(root, lock["name"])
    if safe_dir(root, lock["name"]):
        emit("step", what="remove the unfinished or broken %s (%s)" % (venv, state.get("detail")))
        shutil.rmtree(venv)
    try:
        user = user_of(args)
    except RuntimeError as exc:
        emit("error", message=str(exc))
        return 1
    cache, pythons = os.path.join(root, ".uv-cache"), os.path.join(root, ".python")
    env = isolated(UV_CACHE_DIR=cache, UV_PYTHON_INSTALL_DIR=pythons, UV_NO_CONFIG="1")
    offline = []
    if wheelhouse:
        offline = ["--offline", "--no-index", "--find-links", wheelhouse]
        env["UV_PYTHON_DOWNLOADS"] = "never"
    reqs = os.path.join(root, ".requirements-%s.txt" % lock["name"])
    with open(reqs, "w") as f:      # offline, a wheel URL's line names the wheelhouse's copy ("install")
        f.write("\n".join(args.get("install") or lock["requirements"]) + "\n")
    try:
        for folder in (venv, cache, pythons):
            hand_over(folder, user)
        try:
            run([uv, "venv", "--python", lock["python"], "--no-project"] + (["--offline"] if wheelhouse else [])
                + [venv], env, "uv venv (Python %s)" % lock["python"], user)
            run([uv, "pip", "install", "--python", os.path.join(venv, "bin", "python"), "--link-mode", "copy",
                 "--no-build", "-r", reqs] + (["--require-hashes"] if lock.get("hashed") else []) + offline, env,
                "uv pip install (%d pinned%s)" % (len(lock["requirements"]),
                                                  ", hashes required" if lock.get("hashed") else ""),
                user)
        finally:
            for folder in (cache, pythons):     # root's again whatever happened: a Python the venvs run
                lock_down(folder)
        lock_down(venv)                          # root's before anything in it runs
        verified_at = time.monotonic()
        why, version = verify(venv, lock, user)
        if why:
            raise RuntimeError("the new venv does not verify: " + why)
        verify_seconds = round(time.monotonic() - verified_at, 2)
        size = dir_bytes(venv)
        seconds = round(time.monotonic() - started, 2)
        marker = {"hash": lock["hash"], "lock": {"python": lock["python"], "requirements": lock["requirements"]},
                  "vllm_version": version, "bytes": size, "seconds": seconds, "built_at": time.time()}
        tmp = os.path.join(venv, MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump(marker, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(venv, MARKER))
        record_verdict(venv, lock, version, verify_seconds)       # after the marker: it is in the fingerprint
    except (RuntimeError, OSError) as exc:
        if safe_dir(root, lock["name"]):
            shutil.rmtree(venv, ignore_errors=True)
        emit("error", message=str(exc)[-1500:])
        return 1
    finally:
        try:
            os.remove(reqs)
        except OSError:
            pass
    emit("done", seconds=seconds, built=True, state="ok", vllm_version=version, bytes=size)
    return 0


def listing(args):
    root = args["root"]
    out = {"engines": [], "wheelhouse": {}}  # type: dict
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for name in names:
        path = safe_dir(root, name)
        if path is None:
            continue
        marker = read_json(os.path.join(path, MARKER))
        out["engines"].append({"name": name, "complete": isinstance(marker, dict),
                               "vllm_version": marker.get("vllm_version") if isinstance(marker, dict) else None,
                               "bytes": dir_bytes(path)})
    house = os.path.join(root, ".wheelhouse")
    if os.path.isdir(house) and not os.path.islink(house):
        for name in sorted(os.listdir(house)):
            full = os.path.join(house, name)
            if WHEEL.match(name) and os.path.isfile(full) and not os.path.islink(full):
                out["wheelhouse"][name] = os.path.getsize(full)
    return out


def remove(args):
    path = safe_dir(args["root"], args["name"])
    if path is None:
        return {"removed": False, "why": "not an engine venv folder under %s" % args["root"]}
    shutil.rmtree(path)
    return {"removed": True}


ARGS_FILE = re.compile(r"^\.args-[0-9a-f]{32}\.json$")
ARGS_MAX = 4 << 20


def args_from_file(path):
    """The arguments the controller put in a file (`MODE --args-file PATH`: a large `remember` would
    not fit one argv word, which Linux caps at 128 KiB): read once, then deleted. Only a path named
    .args-<32 hex>.json, a regular file of the running user's without group or other write (opened
    without following links, non-blocking); anything else is refused and left where it is."""
    if not os.path.isabs(path) or not ARGS_FILE.match(os.path.basename(path)):
        raise SystemExit("vllm-orch engine.py: %r is not an args file vllm-orch writes" % path[:200])
    value, why = read_own(path, ARGS_MAX, "args")
    if not isinstance(value, dict):
        raise SystemExit("vllm-orch engine.py: %s (%s)" % (why or "the args file is not an object", path[:200]))
    os.remove(path)
    return value


def main():
    mode = sys.argv[1]
    args = args_from_file(sys.argv[3]) if sys.argv[2] == "--args-file" else json.loads(sys.argv[2])
    if mode == "build":
        return build(args)
    answer = {"check": check, "list": listing, "remove": remove, "remember": remember}[mode](args)
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
