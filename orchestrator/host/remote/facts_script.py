"""Host-side fact gathering: ONE round trip that reports everything a plan needs, as one JSON object.

Run by the host's Python (Python >= 3.8) as `python -c <this file> '<json args>'`.
Raw command output (nvidia-smi) is returned as text and parsed on the controller by pure parsers
(orchestrator/host/nvidia_smi.py), so the parsers are tested on recorded real output.

Process facts (alive, parent, name, command line) and the sockets bound to the service ports come
from psutil when the host's Python can import it - every vLLM venv has it, and the inventory's
`python` defaults to the vLLM venv's - else from /proc by hand (a bare python3). Both give the same
facts; a zombie counts as dead either way. The cgroup is read from /proc (psutil has no API).

What it costs the host is what `status` of a fleet costs (the CPU of every host's round trip): psutil
is imported only when a process or a port is to be looked at (~25 ms of CPU), vLLM's version is read
from its dist-info without importing importlib.metadata (~40 ms; the dist-info of the venv the vllm
executable is in when this Python has no vLLM, e.g. a manifest's engine venv: `vllm --version` only
when neither has one), and the nvidia-smi queries run
side by side. `status` asks for its own subset ("status" in the arguments, see status_extras): no
banner, service user or ports, and the records it shows in the same round trip.
"""

import json
import os
import socket
import stat
import subprocess
import sys
import time

_GONE = OSError                     # psutil.Error (NoSuchProcess, AccessDenied, ZombieProcess) once loaded
_PSUTIL = []  # type: list  # [psutil module or None] once looked for


def ps():
    """psutil, imported on first use (None when the host's Python has none)."""
    global _GONE
    if not _PSUTIL:
        try:
            import psutil
            _GONE = psutil.Error
        except ImportError:
            psutil = None
        _PSUTIL.append(psutil)
    return _PSUTIL[0]


def sh(argv, timeout=20):
    return sh_all([argv], timeout)[0]


def sh_all(argvs, timeout=20):
    """Run commands side by side (nvidia-smi spends its time in the driver, not on a core):
    [{"rc", "out", "err"}] in the order given; 127 not found, 124 timed out."""
    procs = []  # type: list
    for argv in argvs:
        try:
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        except FileNotFoundError:
            procs.append(None)
    deadline = time.monotonic() + timeout
    out = []  # type: list
    for argv, p in zip(argvs, procs):
        if p is None:
            out.append({"rc": 127, "out": "", "err": "%s: not found" % argv[0]})
            continue
        try:
            stdout, stderr = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            out.append({"rc": p.returncode, "out": stdout.decode(errors="replace"),
                        "err": stderr.decode(errors="replace")[-2000:]})
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            out.append({"rc": 124, "out": "", "err": "%s: timed out after %ss" % (argv[0], timeout)})
    return out


def read_json(path, nofollow=False, limit=None):
    """The JSON in `path`, or None. nofollow/limit: a file another user writes (the health state
    is the service user's): never through a link, never waiting on a FIFO (O_NONBLOCK: one planted
    there hung root's open), only a regular file (fstat of what was opened), at most `limit` bytes:
    unit_probe.py's read_data rule."""
    flags = os.O_RDONLY | (getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) if nofollow else 0)
    try:
        fd = os.open(path, flags)
        with os.fdopen(fd, "rb") as f:
            if nofollow and not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            return json.loads(f.read(limit if limit is not None else -1).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def disk(path):
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip("/")) or "/"
    st = os.statvfs(probe)
    return {"path": probe, "total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}


def meminfo(path):
    """The host's memory from /proc/meminfo (or a file in its format): total and available bytes.
    MemAvailable is the kernel's estimate of what can be allocated without swapping (free memory
    plus the reclaimable part of the page cache); psutil.virtual_memory().available reads the very
    same field on Linux, so the file is read by hand whether or not psutil is there."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                words = rest.split()
                if words and words[0].isdigit():
                    fields[key.strip()] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    except OSError as exc:
        return {"path": path, "error": str(exc)}
    if "MemTotal" not in fields:
        return {"path": path, "error": "no MemTotal line"}
    return {"path": path, "total": fields["MemTotal"], "available": fields.get("MemAvailable")}


def dir_bytes(path):
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def models(root):
    out = []  # type: list
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path) or name.startswith("."):
            continue
        out.append({"name": name, "bytes": dir_bytes(path), "mtime": os.path.getmtime(path),
                    "verified": read_json(os.path.join(path, ".vllm-orch", "verified.json"))})
    return out


def alive(pid):
    """Running and not a zombie (an unreaped zombie still has a /proc entry)."""
    psutil = ps()
    if psutil is not None:
        try:
            return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
        except _GONE:
            return False
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] not in "ZX"
    except (OSError, ValueError, IndexError):
        return False


def start_time(pid):
    """The process's start time in clock ticks after boot (/proc/PID/stat field 22): with the boot
    id, what tells a process from a later one that got the same PID."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _user(uid):
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def _ppid(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _title(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            first = f.read().split(b"\0")[0]
        return first.decode(errors="replace")
    except OSError:
        return ""


def engine_root_ppid(pid):
    """The parent of the topmost `VLLM::` process above (and including) pid: 1 when the vLLM
    process tree was re-parented to init because its API server is gone."""
    seen = 0
    while seen < 64:
        parent = _ppid(pid)
        if parent is None or parent <= 1 or not _title(parent).startswith("VLLM::"):
            return parent
        pid, seen = parent, seen + 1
    return None


def proc_info(pid):
    """alive, ppid, pgid, comm (the process name; with psutil the full title when the kernel's
    15-character comm cut it), cmdline, cgroup, owner, start time, whether its process group's
    leader lives, and for vLLM engine processes whether their tree lost its API server."""
    info = {"pid": pid, "alive": alive(pid)}
    if not info["alive"]:
        return info
    psutil = ps()
    try:
        if psutil is not None:
            p = psutil.Process(pid)
            with p.oneshot():
                info["ppid"], info["comm"], info["cmdline"] = p.ppid(), p.name(), p.cmdline()
            info["pgid"] = os.getpgid(pid)
        else:
            with open("/proc/%d/stat" % pid) as f:
                stat = f.read()
            rest = stat[stat.rindex(")") + 2:].split()
            info["ppid"], info["pgid"] = int(rest[1]), int(rest[2])
            with open("/proc/%d/comm" % pid) as f:
                info["comm"] = f.read().strip()
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                info["cmdline"] = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        info["start_time"] = start_time(pid)
        uid = os.stat("/proc/%d" % pid).st_uid
        info["uid"], info["user"] = uid, _user(uid)
        info["leader_alive"] = info["pgid"] == pid or alive(info["pgid"])
        if (info.get("cmdline") or [""])[0].startswith("VLLM::"):
            info["engine_root_ppid"] = engine_root_ppid(pid)
        with open("/proc/%d/cgroup" % pid) as f:
            info["cgroup"] = f.read().strip()
    except (OSError, ValueError, IndexError, _GONE):    # it left meanwhile, or is not ours to read
        pass
    return info


def worker_range(named):
    """The ports of a Ray node's worker port range (min_worker_port .. max_worker_port), when sane."""
    low, high = str(named.get("min_worker_port", "")), str(named.get("max_worker_port", ""))
    if low.isdigit() and high.isdigit() and 0 <= int(high) - int(low) < 10000:
        return list(range(int(low), int(high) + 1))
    return []


def port_holders(ports):
    """Processes with a TCP socket listening (or bound with no peer) on each port: {port: [pid]};
    [None] when the socket is there but its owner is not visible to us (another user's, not root)."""
    wanted = {int(p) for p in ports}
    found = {str(p): [] for p in wanted}  # type: dict
    seen = set()  # type: set
    if not wanted:
        return found
    psutil = ps()
    if psutil is not None:
        try:
            conns = psutil.net_connections(kind="tcp")
        except (_GONE, OSError):
            conns = None
        if conns is not None:
            for c in conns:
                if (c.laddr and c.laddr.port in wanted and not c.raddr
                        and c.status in (psutil.CONN_LISTEN, psutil.CONN_CLOSE)):
                    seen.add(str(c.laddr.port))
                    if c.pid is not None and c.pid not in found[str(c.laddr.port)]:
                        found[str(c.laddr.port)].append(c.pid)
            return _unseen_owner(found, seen)
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    port = int(parts[1].rsplit(":", 1)[1], 16)
                    remote_port = int(parts[2].rsplit(":", 1)[1], 16)
                    if port in wanted and parts[3] in ("0A", "07") and remote_port == 0:
                        inodes[parts[9]] = port
                        seen.add(str(port))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    if not inodes:
        return found
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir("/proc/%s/fd" % pid):
                target = os.readlink("/proc/%s/fd/%s" % (pid, fd))
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    holders = found[str(inodes[target[8:-1]])]
                    if int(pid) not in holders:
                        holders.append(int(pid))
        except OSError:
            continue
    return _unseen_owner(found, seen)


def _unseen_owner(found, seen):
    for port in found:
        if not found[port] and port in seen:
            found[port].append(None)        # bound, but the owner is not visible to us
    return found


def systemd_state(unit):
    r = sh(["systemctl", "show", unit, "-p",
            "LoadState,ActiveState,SubState,MainPID,Result,NRestarts,ExecMainStartTimestampMonotonic,ControlGroup,"
            "UnitFileState"])
    state = {}
    for line in r["out"].splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            state[k] = v
    return state


def process_state(pidfile, boot_id):
    """A `process` service from its record `PGID BOOT_ID START_TIME`. The group is reported as the
    service's (PGID) only when the record provably names the group vllm-orch started: written in
    this boot, and a live leader is the very process started then (same start time); otherwise
    the record is stale (a reboot, a reused PID) and nothing is attributed to the service.
    orchestrator/host/services.py's stop and state commands apply the same rule in shell."""
    try:
        with open(pidfile) as f:
            words = f.read().split()
        pid = int(words[0])
    except (OSError, ValueError, IndexError):
        return {"ActiveState": "inactive", "MainPID": "0"}
    if pid <= 1 or words[0] != str(pid):       # 0, 1, -1, +5, 007: no group vllm-orch started (services.py)
        return {"ActiveState": "inactive", "MainPID": "0",
                "StaleRecord": "the record names no process group vllm-orch started"}
    recorded_boot = words[1] if len(words) > 1 else None
    recorded_start = words[2] if len(words) > 2 else None
    if recorded_boot != boot_id:
        return {"ActiveState": "inactive", "MainPID": "0",
                "StaleRecord": "recorded in another boot (or by an older vllm-orch)"}
    current = start_time(pid)
    if current is not None and str(current) != recorded_start:
        return {"ActiveState": "inactive", "MainPID": "0", "StaleRecord": "PID %d is another process now" % pid}
    running = alive(pid)
    started = os.path.getmtime(pidfile)
    return {"ActiveState": "active" if running else "failed", "MainPID": str(pid) if running else "0",
            "PGID": str(pid), "StartedAt": str(started)}


def users(names):
    """{name: {"uid", "gid", "home"} or None}: whether the service user exists (the plan creates it)."""
    import pwd
    out = {}  # type: dict
    for name in names:
        try:
            entry = pwd.getpwnam(name)
            out[name] = {"uid": entry.pw_uid, "gid": entry.pw_gid, "home": entry.pw_dir}
        except KeyError:
            out[name] = None
    return out


def service_reach(path, user):
    """Can `user` (the service user) run `path` (the vllm executable, and the interpreter its #! line
    names)? {"user", "path", "exists", "problems": [...], "unchecked": [...]}; no problems = yes. Every folder
    on the way needs search (x) permission, a script r+x, a binary x. A user deploy is about to create
    (a system user with its own group) is judged by the "other" bits. ACLs are not read."""
    import pwd
    import stat as st_mod
    try:
        pw = pwd.getpwnam(user)
        uid, gids = pw.pw_uid, set(os.getgrouplist(user, pw.pw_gid))
    except KeyError:
        uid, gids = None, set()
    out = {"user": user, "path": path, "exists": uid is not None, "problems": [], "unchecked": []}  # type: dict
    if uid == 0:
        return out
    if "/" not in path:
        out["unchecked"].append("%s: found through PATH, not a path" % path)
        return out

    def owner(s):
        try:
            name = pwd.getpwuid(s.st_uid).pw_name
        except KeyError:
            name = str(s.st_uid)
        return "%s %s" % (st_mod.filemode(s.st_mode), name)

    def allows(s, bits):
        shift = 6 if s.st_uid == uid else 3 if s.st_gid in gids else 0
        return (s.st_mode >> shift) & bits == bits

    def look(p, bits, what):
        try:
            s = os.stat(p)
        except FileNotFoundError:
            return None
        except OSError as exc:
            out["unchecked"].append("%s: %s" % (p, exc.strerror or exc))
            return None
        if not allows(s, bits):
            line = "%s (%s) %s" % (p, owner(s), what)
            if line not in out["problems"]:
                out["problems"].append(line)
        return s

    def reach(p, depth=0):
        absolute = os.path.abspath(p)
        real = os.path.realpath(absolute)
        for chain in (absolute, real):
            parts = chain.split("/")[1:-1]
            for i in range(len(parts)):
                look("/" + "/".join(parts[:i + 1]), 1, "does not let %s in" % user)
        try:
            with open(real, "rb") as f:
                head = f.read(256)
        except OSError:
            head = b""
        script = head.startswith(b"#!")
        if look(real, 5 if script else 1, "is not %s by %s" % ("readable and executable" if script
                                                                else "executable", user)) is None:
            return
        if script and depth == 0:
            words = head[2:].split(b"\n")[0].split()
            if words and not words[0].endswith(b"/env"):
                reach(words[0].decode(errors="replace"), 1)

    reach(path)
    return out


def others_can_change(st):
    """Why a user other than root (and other than whoever runs this, when that is not root: then
    nothing vllm-orch runs here runs as root) can change this folder's entries or this file's bytes,
    or None: another owner, write permission for everyone, or for another group."""
    import stat as st_mod
    if st.st_uid not in (0, os.geteuid()):
        return "owned by %s" % _user(st.st_uid)
    if st.st_mode & st_mod.S_IWOTH:
        return "writable by everyone"
    if st.st_mode & st_mod.S_IWGRP and st.st_gid not in (0, os.getegid()):
        try:
            import grp
            group = grp.getgrgid(st.st_gid).gr_name
        except (KeyError, ImportError):
            group = str(st.st_gid)
        return "writable by group %s" % group
    return None


def trust_problem(path):
    """Why a user other than root could change what `path` names, or None. Every existing part from
    / on is read with lstat: each folder on the way, and the last part itself; a symlink is followed
    (its target checked the same way: who can change the link is whoever can change its folder). A
    sticky folder writable by everyone (/tmp) is trusted above a part that already exists and is
    root's (nobody else can rename or remove it); a part that does not exist yet there could be
    made by anyone first. Parts that do not exist under a trusted folder are made by root later."""
    import stat as st_mod
    if not path.startswith("/"):
        return "not an absolute path"
    todo = [p for p in path.split("/") if p]
    cur = "/"
    hops = 0
    while True:
        try:
            here = os.lstat(cur)
        except OSError as exc:
            return "%s: %s" % (cur, exc.strerror or exc)
        why = others_can_change(here)
        sticky = here.st_mode & st_mod.S_ISVTX and here.st_uid in (0, os.geteuid())
        if not todo:
            return "%s is %s" % (cur, why) if why else None
        child = os.path.join(cur, todo[0])
        try:
            st = os.lstat(child)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            return "%s: %s" % (child, exc.strerror or exc)
        if why and not (sticky and st is not None and st.st_uid in (0, os.geteuid())):
            if sticky:
                return ("%s does not exist yet, and %s lets anyone make it first: make it as root" % (child, cur)
                        if st is None else "%s is owned by %s in %s, which anyone can write" % (
                            child, _user(st.st_uid), cur))
            return "%s is %s" % (cur, why)
        if st is None:
            return None                        # made by root later, in a folder only root can change
        todo.pop(0)
        if st_mod.S_ISLNK(st.st_mode):
            hops += 1
            if hops > 40:
                return "%s: too many symlinks" % child
            target = os.readlink(child)
            todo = [p for p in target.split("/") if p] + todo
            cur = "/" if target.startswith("/") else cur
            continue
        cur = child


def root_trust(programs, folders):
    """What vllm-orch runs or writes as root that another user could change: {"programs":
    [{"path", "problem"}], "folders": [...]} (problem None: only root can). The programs: the host's
    Python (it runs every helper and the units' root-run parts; so do the folders on its sys.path
    and what sits at the top of its site-packages: a `.pth` file there runs at every start), and the
    others given (nvidia-smi; vLLM when the service runs as root). A bare name is found on PATH."""
    import shutil
    out = {"programs": [], "folders": []}  # type: dict
    seen = set()  # type: set

    def add(kind, path):
        if path and path not in seen:
            seen.add(path)
            out[kind].append({"path": path, "problem": trust_problem(path)})

    for prog in programs:
        for word in prog.split():           # `/usr/bin/env python3`: env, and the python3 it finds
            add("programs", word if "/" in word else (shutil.which(word) or ""))
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            add("programs", os.path.abspath(entry))
            if os.path.basename(entry) in ("site-packages", "dist-packages"):
                try:
                    names = sorted(os.listdir(entry))
                except OSError:
                    names = []
                for name in names:
                    full = os.path.join(entry, name)
                    try:
                        why = others_can_change(os.lstat(full))
                    except OSError:
                        continue
                    if why and full not in seen:
                        seen.add(full)
                        out["programs"].append({"path": full, "problem": "%s is %s" % (full, why)})
    for folder in folders:
        add("folders", folder)
    # nft: the dev-mode guard of a sleep-capable service runs it as root (render/artifacts.py
    # dev_guard_rules); root's PATH over SSH may lack the sbin folders, systemd's has them.
    nft = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)
    out["nft"] = nft
    if nft:
        add("programs", nft)
    return out


def dist_version(name, folders=None):
    """The installed version of distribution `name` (lower case, no `-` or `_` in it), as
    importlib.metadata.version gives it, without importing importlib.metadata (it costs the host
    more CPU than the rest of this script): the Version: of the first `name-*.dist-info` on sys.path.
    Anything else (an .egg-info, a zipped path) is left to importlib.metadata. With `folders` (another
    Python's site-packages): only their dist-info folders, None otherwise."""
    metadata_version = _metadata_version if folders is None else (lambda _name: None)
    for folder in sys.path if folders is None else folders:
        try:
            entries = os.listdir(folder or ".")
        except OSError:
            continue
        for entry in entries:
            low = entry.lower()
            if not low.startswith(name + "-") and not low.startswith(name + "."):
                continue
            if low.endswith(".dist-info"):
                try:
                    with open(os.path.join(folder or ".", entry, "METADATA"), encoding="utf-8",
                              errors="replace") as f:
                        for line in f:
                            if not line.strip():
                                break           # the end of the headers
                            if line.startswith("Version:"):
                                return line.split(":", 1)[1].strip() or None
                except OSError:
                    pass
            if low.endswith((".dist-info", ".egg-info", ".egg-link")):
                return metadata_version(name)
    return metadata_version(name)


def venv_dist_version(exe, name):
    """The version of `name` in the venv whose bin/ holds the executable exe (`<venv>/bin/vllm`, e.g.
    a manifest's engine venv when this Python is another), from its dist-info: None when exe is not
    in a venv. Reading it costs a listing; `vllm --version` imports vLLM (tens of seconds of CPU)."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(exe)))
    if "/" not in exe or not os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        return None
    try:
        libs = sorted(os.listdir(os.path.join(venv, "lib")))
    except OSError:
        return None
    return dist_version(name, [os.path.join(venv, "lib", lib, "site-packages") for lib in libs
                               if lib.startswith("python")])


def _metadata_version(name):
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:
        return None


def tail_lines(path, count, block=65536):
    """The last `count` lines of a file (as `tail -n`), read from its end; [] when unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos, data = f.tell(), b""
            while pos > 0 and data.count(b"\n") <= count:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except OSError:
        return []
    return [line.decode(errors="replace") for line in data.splitlines()[-count:]] if count > 0 else []


def lock_holder(state_dir):
    """Who holds the deploy lock (`flock` on state_dir/lock/deploy.lock, or on the previous
    state_dir/deploy.lock by an older vllm-orch), from its holder file state_dir/deploy.lock.json
    ({"holder": "unknown"} when that is unreadable); None when it is free or there is no lock file,
    or a holder file that is not a JSON object. A lock we cannot even open counts as held, as
    `flock -n` says. host/state.py (lock_path, lock_holder) names the same files."""
    import fcntl
    held = False
    for lock in (os.path.join(state_dir, "lock", "deploy.lock"), os.path.join(state_dir, "deploy.lock")):
        if not os.path.exists(lock):
            continue
        try:
            fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)            # also releases the lock if we got it
        except OSError:
            held = True
    if not held:
        return None
    lock = os.path.join(state_dir, "deploy.lock")
    try:
        with open(lock + ".json") as f:
            text = f.read()
    except OSError:
        return {"holder": "unknown"}
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def json_records(folder):
    """{NAME: record} of every NAME.json in folder that holds a JSON object (services/, installed/)."""
    out = {}
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                rec = read_json(os.path.join(folder, name))
                if isinstance(rec, dict) and rec:
                    out[name[:-5]] = rec
    return out


def status_extras(state_dir, history_tail):
    """What `status` shows besides the facts (orchestrator/ops/status.py): the host's uptime clock
    (systemd start times are monotonic), who holds the deploy lock, the health timer's last check
    of each model (state_dir/health/NAME.json), the gateway's record (gateway/gateway.json: is one
    installed) and the last lines of history.jsonl (parsed by the controller, like every answer)."""
    try:
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        uptime = None
    health = {}
    folder = os.path.join(state_dir, "health")
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        names = []
    for name in names:
        if name.endswith(".json"):
            value = read_json(os.path.join(folder, name), nofollow=True, limit=65536)   # the service user's
            if isinstance(value, dict):
                health[name[:-5]] = value
    gateway = read_json(os.path.join(state_dir, "gateway", "gateway.json"), nofollow=True, limit=65536)
    return {"uptime": uptime, "lock": lock_holder(state_dir), "health": health, "gateway": gateway,
            "history": tail_lines(os.path.join(state_dir, "history.jsonl"), history_tail)}


def main():
    args = json.loads(sys.argv[1])
    state_dir = args["state_dir"]
    status = args.get("status")         # status's subset: {"history_tail": N}
    facts = {"hostname": socket.gethostname(), "time": time.time(),
             "python": sys.version.split()[0]}  # type: dict
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            facts["boot_id"] = f.read().strip()
    except OSError:
        facts["boot_id"] = None
    facts["disk"] = disk(args["models_root"])
    facts["memory"] = meminfo(args.get("meminfo") or "/proc/meminfo")
    queries = [args["gpu_query"], args["apps_query"]] + ([] if status else [[args["nvidia_smi"]]])
    answers = sh_all(queries)
    facts["gpus_raw"], facts["apps_raw"] = answers[0], answers[1]
    if not status:      # the driver and CUDA versions: status does not show them
        facts["banner_raw"] = answers[2]
    version = dist_version("vllm")
    exists = os.access(args["vllm"], os.X_OK) if "/" in args["vllm"] else None
    if version is None and exists:
        version = venv_dist_version(args["vllm"], "vllm")
    facts["vllm"] = {"path": args["vllm"], "exists": exists, "version": version}
    if version is None and facts["vllm"]["exists"] is not False:
        r = sh([args["vllm"], "--version"], timeout=120)
        lines = [l for l in r["out"].splitlines() if l.strip()]
        facts["vllm"]["version"] = lines[-1].strip() if r["rc"] == 0 and lines else None
        facts["vllm"]["error"] = None if r["rc"] == 0 else (r["err"] or r["out"])[-500:]
    facts["models"] = models(args["models_root"])
    if not status:
        facts["users"] = users(args.get("users", []))
        facts["service_reach"] = service_reach(args["vllm"], args["users"][0]) if args.get("users") else None
        if args.get("trust") is not None:
            facts["root_trust"] = root_trust(args["trust"]["programs"], args["trust"]["folders"])
    facts["active"] = read_json(os.path.join(state_dir, "active.json"))     # a host's legacy record
    records = facts["records"] = json_records(os.path.join(state_dir, "services"))
    wanted = list(args.get("models", []))
    if status and isinstance(facts["active"], dict) and isinstance(facts["active"].get("model"), str):
        wanted.append(facts["active"]["model"])     # its service state even when nothing is installed
    facts["swap"] = read_json(os.path.join(state_dir, "swap.json"))
    facts["usage"] = read_json(os.path.join(state_dir, "usage.json")) or {}
    installed = facts["installed"] = json_records(os.path.join(state_dir, "installed"))
    services = {}
    for name in sorted(set(installed) | set(records) | set(wanted)):
        if args["manager"] == "systemd":
            services[name] = systemd_state("vllm-%s.service" % name)
        else:
            services[name] = process_state(os.path.join(state_dir, "run", "vllm-%s.pid" % name),
                                           facts["boot_id"])
    facts["services"] = services
    # Who holds each recorded or installed service's ports too (its API port, and a multi-node
    # service's cluster_ports): a placement's ports are checked against theirs, and a service placed
    # earlier (its installed record) keeps its ports (status shows no port holders, so it reads no
    # port table).
    ports = set(int(p) for p in args.get("ports", []))
    for rec in [] if status else list(records.values()) + list(installed.values()) + [facts["active"]]:
        if not isinstance(rec, dict):
            continue
        named = {}                                  # a multi-node service's ports (master_port, Ray's...)
        for key in ("cluster_ports", "node_ports"):
            if isinstance(rec.get(key), dict):
                named.update(rec[key])
        for port in [rec.get("port")] + list(named.values()) + worker_range(named):
            text = str(port or "")
            if text.isdigit() and 0 < int(text) < 65536:
                ports.add(int(text))
    facts["ports"] = port_holders(sorted(ports))
    pids = set(p for holders in facts["ports"].values() for p in holders if p)
    for line in facts["apps_raw"]["out"].splitlines():
        first = line.split(",")[0].strip()
        if first.isdigit():
            pids.add(int(first))
    for svc in services.values():
        if svc.get("MainPID", "0").isdigit() and int(svc.get("MainPID", "0")):
            pids.add(int(svc["MainPID"]))
    facts["procs"] = {str(p): proc_info(p) for p in sorted(pids)}
    if status:
        facts["status"] = status_extras(state_dir, int(status.get("history_tail", 500)))
    if not status:
        ps()            # the full facts say which psutil the host has; status reads none when idle
    psutil = _PSUTIL[0] if _PSUTIL else None
    facts["psutil"] = psutil.__version__ if psutil else None
    print(json.dumps(facts))


main()
