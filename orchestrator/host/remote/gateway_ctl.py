"""The gateway's runtime, on the host (stdlib only): HAProxy's master CLI and each worker's stats.

    python - state  RUN_DIR                    -> {"workers": [...], "backends": {NAME: {...}}}
    python - reload RUN_DIR CFG HAPROXY        -> checks CFG (haproxy -c), reloads, waits for the new worker
    python - idle   RUN_DIR BACKEND TIMEOUT_S [HOST:PORT]
                                               -> waits until no worker has a request of BACKEND in flight,
                                                  or (HOST:PORT given) nothing listens there any more

Every worker counts: after a reload the old worker finishes the streams it carries, so a drain
waits for the old workers' requests of the backend too (the master CLI reaches each by `@!PID`).
One JSON line answers.
"""

from __future__ import annotations

import csv
import io
import json
import socket
import subprocess
import sys
import time


def cli(run_dir: str, command: str, timeout: float = 5.0) -> str:
    """One command on the master CLI. The master re-executes itself on a reload and opens its socket
    again: refused (or absent) for a moment, or a connection it had accepted reset, so that is retried
    for up to 10 s. Every command here but `reload` only reads; a `reload` whose connection is reset
    after it was sent is not sent again (the caller waits for its new worker, the reload's proof)."""
    deadline = time.monotonic() + 10
    while True:
        sent = False
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        try:
            s.connect(f"{run_dir}/master.sock")
            s.sendall((command + "\n").encode())
            sent = True
            s.shutdown(socket.SHUT_WR)
            out = b""
            while True:
                block = s.recv(65536)
                if not block:
                    return out.decode(errors="replace")
                out += block
        except (ConnectionRefusedError, FileNotFoundError, ConnectionResetError, BrokenPipeError):
            if sent and command == "reload":
                return ""
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            s.close()


def refused(target: str) -> bool:
    """Whether HOST:PORT refuses a connection: nothing listens there, so the requests HAProxy has
    in flight to it are only waiting for its port (a service that died, or one whose start failed).
    A connection that times out proves nothing (a busy host) and is not refused."""
    address, _, port = target.rpartition(":")
    try:
        with socket.create_connection((address.strip("[]"), int(port)), timeout=1.0):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


def workers(run_dir: str) -> list[dict]:
    """The master's workers (the current one and old ones still finishing), from `show proc`."""
    out, section = [], ""
    for line in cli(run_dir, "show proc").splitlines():
        if line.startswith("# "):
            section = line[2:].strip()
            continue
        words = line.split()
        if section.endswith("workers") and words and words[0].isdigit():      # "workers", "old workers"
            out.append({"pid": int(words[0]), "reloads": int(words[2]) if len(words) > 2 and words[2].isdigit() else 0})
    return out


DEMAND_TABLE = "gw_demand"      # render/gateway.py DEMAND_TABLE


def demand(run_dir: str, pid: int) -> dict[str, dict]:
    """Per backend in one worker's demand table: requests now (waiting at the gateway or in flight:
    conn_cur) and requests routed to it since the worker started (http_req_cnt)."""
    out = {}
    for line in cli(run_dir, f"@!{pid} show table {DEMAND_TABLE}").splitlines():
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if "key" in fields:
            try:
                out[fields["key"]] = {"active": int(fields.get("conn_cur", 0)), "routed": int(fields.get("http_req_cnt", 0))}
            except ValueError:
                continue
    return out


def backends(run_dir: str, pids: list[int]) -> dict:
    """Per backend, summed over the workers: requests in flight and queued, totals and 5xx answers,
    requests now and routed (the demand table), and its server's state in the newest worker."""
    total: dict[str, dict] = {}
    for i, pid in enumerate(pids):
        text = cli(run_dir, f"@!{pid} show stat")
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        for row in rows:
            name, kind = row.get("pxname") or "", row.get("svname") or ""
            if kind == "s1" and i == 0:
                total.setdefault(name, _zero(row))["server"] = row.get("status") or ""
            if kind != "BACKEND" and kind != "FRONTEND":
                continue
            key = name if kind == "BACKEND" else f"frontend:{name}"
            t = total.setdefault(key, _zero(row))
            if kind == "BACKEND" and i == 0:
                t["status"] = row.get("status") or ""
            for field, out in (("scur", "inflight"), ("qcur", "queued"), ("req_tot" if kind == "FRONTEND" else "stot",
                                                                           "requests"),
                               ("hrsp_5xx", "errors_5xx"), ("wretr", "retries")):
                try:
                    t[out] += int(row.get(field) or 0)
                except ValueError:
                    pass
        for name, d in demand(run_dir, pid).items():
            t = total.setdefault(name, _zero({}))
            t["active"] += d["active"]
            t["routed"] += d["routed"]
    return total


def _zero(row: dict) -> dict:
    return {"inflight": 0, "queued": 0, "requests": 0, "errors_5xx": 0, "retries": 0, "active": 0, "routed": 0,
            "status": row.get("status") or "", "server": ""}


def main(argv: list[str]) -> int:
    what, run_dir = argv[0], argv[1]
    try:
        if what == "state":
            ws = workers(run_dir)
            print(json.dumps({"ok": True, "workers": ws, "backends": backends(run_dir, [w["pid"] for w in ws])}))
        elif what == "reload":
            cfg, haproxy = argv[2], argv[3]
            check = subprocess.run([haproxy, "-c", "-q", "-f", cfg], capture_output=True, text=True, timeout=60)
            if check.returncode:
                print(json.dumps({"ok": False, "error": "haproxy -c: " + (check.stderr or check.stdout).strip()[-400:]}))
                return 1
            before = {w["pid"] for w in workers(run_dir)}
            cli(run_dir, "reload")
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                now = workers(run_dir)
                new = [w for w in now if w["pid"] not in before]
                if new:
                    print(json.dumps({"ok": True, "worker": new[0]["pid"], "old": sorted(before)}))
                    return 0
                time.sleep(0.1)
            print(json.dumps({"ok": False, "error": "no new worker 20 s after the reload"}))
            return 1
        elif what == "idle":
            backend, timeout = argv[2], float(argv[3])
            target = argv[4] if len(argv) > 4 else ""
            t0 = time.monotonic()
            probed = -1.0
            while True:
                b = backends(run_dir, [w["pid"] for w in workers(run_dir)]).get(backend, {})
                left = int(b.get("inflight", 0)) + int(b.get("queued", 0))
                waited = time.monotonic() - t0
                closed = False
                if left and target and waited - probed >= 1.0:
                    probed = waited
                    closed = refused(target)
                if left == 0 or waited >= timeout or closed:
                    print(json.dumps({"ok": True, "left": left, "waited_s": round(waited, 3), "closed": closed}))
                    return 0
                time.sleep(0.2)
        else:
            print(json.dumps({"ok": False, "error": f"unknown command {what}"}))
            return 2
    except OSError as exc:
        print(json.dumps({"ok": False, "error": f"the gateway's master socket: {exc}"}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
