"""`vllm-orch sim ...`: run SIMULATED GPU hosts (fake vLLM server, fake nvidia-smi, hub mirror).

Everything printed and recorded says SIMULATED, so nobody mistakes a sim host for a real one.
"""

from __future__ import annotations

import json

import click

from orchestrator.cli.options import exit_codes, json_option
from orchestrator.sim import manager


@click.group("sim", epilog=exit_codes("0 ok, 1 failed, 2 bad input, 3 refused (e.g. --systemd without "
                                      "root or systemd-nspawn)."))
def sim():
    """Run SIMULATED GPU hosts on this machine (no GPU needed).

    \b
      vllm-orch sim up            start host `sim` (and `sim-2`... with --hosts N)
      vllm-orch sim status        what is running
      vllm-orch sim fault sim hang --model kimi-k25-int4
      vllm-orch sim reboot sim    reboot a --systemd host (enabled units start again)
      vllm-orch sim memory sim --available-gib 600
      vllm-orch sim down          stop everything `up` started and remove its state
    """


@sim.command("up", epilog=exit_codes("0 the hosts are up, 1 a process did not start, 2 bad input, "
                                     "3 refused (--systemd without root or systemd-nspawn)."))
@click.option("--hosts", "hosts", default=1, show_default=True, help="How many simulated hosts.")
@click.option("--speed", type=float,
              help="Weight loading runs this many times faster than the field report's "
                   f"253 MB/s (default {manager.DEFAULT_SPEED:g}: Kimi loads in ~11 s; "
                   "a host already up keeps its speed).")
@click.option("--scale", default=manager.DEFAULT_SCALE, show_default=True, type=int,
              help="The hub mirror serves files this many times smaller than the real ones.")
@click.option("--systemd", is_flag=True,
              help="Each host is a Debian container with real systemd and sshd (Linux, root).")
@click.option("--vllm-python", type=click.Path(exists=True, dir_okay=False),
              help="Record this Python (with a real vLLM installed) as the hosts' python.")
@click.option("--real-vllm", is_flag=True,
              help="The hosts' vLLM is the REAL one: vLLM's CPU build (built once per machine, "
                   "~2.5 min, ~3.3 GiB), serving the tiny-llama-* models. See docs/real-vllm.md.")
@click.option("--ram-gib", type=click.FloatRange(min=1),
              help="The hosts' RAM in real GiB, reported scaled like the files (default 1536, a typical "
                   "8-GPU server; a host already up keeps its RAM).")
@click.option("--available-gib", type=click.FloatRange(min=1),
              help="Memory available when no simulated vLLM runs, real GiB (default: RAM - 64).")
def up_cmd(hosts, speed, scale, systemd, vllm_python, real_vllm, ram_gib, available_gib):
    """Start SIMULATED hosts (idempotent) and add them to the inventory (hosts.d/sim.yaml in
    vllm-orch's state home, which every command reads)."""
    if real_vllm:
        from orchestrator.devtools import real_vllm_venv
        if not real_vllm_venv.is_built():
            click.echo("building vLLM's CPU build venv (once per machine, a few minutes): "
                       f"{real_vllm_venv.venv_dir()}", err=True)
    state = manager.up(hosts, speed=speed, scale=scale, systemd=systemd,
                       vllm_python=vllm_python, real_vllm=real_vllm, ram_gib=ram_gib, available_gib=available_gib)
    home = manager.sim_home()
    click.echo(f"SIMULATED GPU hosts (home {home}):")
    for name, rec in state["hosts"].items():
        news = rec.get("started_now") or []
        hub = rec["processes"].get("hub")
        click.echo(f"  {name}: SIMULATED 8x {manager.GPU_NAME} ({rec['flavour']}, "
                   f"speed {rec['speed']:g}) in {rec['dir']}")
        click.echo("    hub mirror: " + (f"http://127.0.0.1:{hub['port']} (pid {hub['pid']})"
                                         if hub else "not started (orchestrator.sim.hub is "
                                                     "not available in this build)"))
        click.echo("    " + ("started now: " + ", ".join(news) if news else
                             "already running, nothing started"))
        if rec.get("real_vllm"):
            click.echo("    vLLM: REAL (vLLM's CPU build) - deploy the tiny-llama-* models; preflight "
                       "skips torch-cuda (its torch is a CPU build)")
        elif rec["flavour"] == "systemd":
            click.echo("    preflight: the flags and env checks are skipped (the container has no real vLLM)")
        elif not rec.get("python"):
            click.echo("    preflight: the flags and env checks are skipped (no real vLLM to parse "
                       "them; `--vllm-python PATH` records one)")
    click.echo(f"  inventory: {manager.inventory_file(home)}")


@sim.command("status", epilog=exit_codes("0 ok (also when no host is up)."))
@json_option("Print the status as JSON.")
def status_cmd(as_json):
    """Show the SIMULATED hosts and what runs on them."""
    st = manager.status()
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    if not st["up"]:
        click.echo(f"SIMULATED hosts: none (home {st['home']}); start them with: vllm-orch sim up")
        return
    click.echo(f"SIMULATED hosts (home {st['home']}):")
    for name, h in st["hosts"].items():
        click.echo(f"  {name}: SIMULATED, {h['flavour']}, speed {h['speed']:g}, {h['dir']}")
        click.echo(f"    vLLM: {h['vllm']}")
        for kind, p in h["processes"].items():
            port = f" port {p['port']}" if "port" in p else ""
            click.echo(f"    {kind}: pid {p['pid']}{port} "
                       f"{'running' if p['alive'] else 'NOT RUNNING'}")
        for s in h["vllm_servers"]:
            where = (f"headless, node rank {s.get('node_rank')} of {s.get('nnodes')}, head {s.get('head')}"
                     if s.get("headless") else f"port {s['port']}")
            click.echo(f"    SIMULATED vllm serve pid {s['pid']} {where}: {s['model']}")
        by_gpu: dict[int, list[str]] = {}
        for g in h["gpu_holders"]:
            by_gpu.setdefault(g["gpu_index"], []).append(f"{g['process_name']}({g['pid']})")
        for gpu in sorted(by_gpu):
            click.echo(f"    GPU {gpu}: " + ", ".join(by_gpu[gpu]))
        for f in h["faults"]:
            click.echo(f"    pending fault: {f['fault']} (model {f.get('model') or 'any'})")


@sim.command("memory", epilog=exit_codes("0 ok, 2 unknown host or impossible sizes."))
@click.argument("host")
@click.option("--ram-gib", type=click.FloatRange(min=1), help="The host's RAM, real GiB.")
@click.option("--available-gib", type=click.FloatRange(min=1),
              help="Memory available when no simulated vLLM runs, real GiB.")
def memory_cmd(host, ram_gib, available_gib):
    """Change SIMULATED HOST's RAM or available memory now (e.g. to see a warm-up stop short)."""
    info = manager.set_memory(host, ram_gib=ram_gib, available_gib=available_gib)
    click.echo(f"SIMULATED host {host}: {info['ram_bytes'] / 2 ** 30:g} GiB RAM, "
               f"{info['available_bytes'] / 2 ** 30:g} GiB available without vLLM (reported 1/{info['scale']} "
               f"of that, like its files)")


@sim.command("down", epilog=exit_codes("0 ok (also when nothing was up)."))
def down_cmd():
    """Stop everything `sim up` started (by PID) and remove the SIMULATED hosts' state; also
    remove test hosts that a killed test run left behind (as root)."""
    stopped = manager.down()
    for line in stopped:
        click.echo(f"stopped SIMULATED {line}")
    click.echo(f"SIMULATED hosts removed ({len(stopped)} processes stopped).")
    for line in manager.reap_stale_test_hosts():
        click.echo(f"removed a stale test host: {line}")


@sim.command("reboot", epilog=exit_codes("0 rebooted, 1 it did not come back, 2 not a --systemd host."))
@click.argument("host")
def reboot_cmd(host):
    """`systemctl reboot` inside a --systemd SIMULATED HOST, then boot it again (what was
    installed stays; units enabled at boot start)."""
    box = manager.reboot(host)
    click.echo(f"SIMULATED host {host}: rebooted (systemd-nspawn pid {box['pid']}, "
               f"{box['_timings'].get('total', 0):.1f}s to boot).")


@sim.command("fault", epilog=exit_codes("0 ok, 2 unknown host or fault, or a missing argument."))
@click.argument("host", required=False)
@click.argument("fault", required=False)
@click.option("--model", help="Apply at the next start of this model only (default: any model).")
@click.option("--times", type=click.IntRange(min=1), default=1, show_default=True,
              help="Fire at this many starts (a failure that comes back at every restart).")
@click.option("--list", "list_", is_flag=True, help="List the faults that can be injected.")
@click.option("--clear", is_flag=True, help="Remove HOST's pending faults and restore its packages.")
def fault_cmd(host, fault, model, times, list_, clear):
    """Inject FAULT into SIMULATED HOST: it applies to the next start of the model (or any).

    On a multi-node service each node is its own host: `vllm-orch sim fault sim-2 unreachable-head`
    makes that node's ranks fail to reach the head; the other nodes then fail as vLLM's do."""
    if list_:
        for name, doc in manager.fault_catalog().items():
            click.echo(f"{name:<26} {doc}")
        return
    if not host:
        raise click.UsageError("HOST is required (or --list)")
    if clear:
        manager.clear_faults(host)
        click.echo(f"SIMULATED host {host}: pending faults cleared, packages restored.")
        return
    if not fault:
        raise click.UsageError("FAULT is required (see --list)")
    manager.add_fault(host, fault, model, **({"times": times} if times > 1 else {}))
    click.echo(f"SIMULATED host {host}: fault {fault} armed for the next "
               f"{f'{times} starts' if times > 1 else 'start'} of {model or 'any model'}.")
