"""Commands that only read manifests and the inventory: models, validate, render, schema, hosts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from orchestrator.cli.common import console, load_host_entry, pass_app, resolved_models_dir
from orchestrator.cli.deploy import placement_options, service_request
from orchestrator.cli.options import exit_codes, host_option, json_option, model_argument
from orchestrator.config.hardware import CLASS_KEYS
from orchestrator.errors import ConfigError


def _size(n: int | None) -> str:
    if not n:
        return "-"
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= div:
            return f"{n / div:.0f} {unit}" if n >= 100 * div else f"{n / div:.1f} {unit}"
    return f"{n} B"


def parallelism(v) -> str:
    parts = [f"TP{v.tensor_parallel_size}"] if v.tensor_parallel_size > 1 or v.world_size == 1 else []
    if v.pipeline_parallel_size > 1:
        parts.append(f"PP{v.pipeline_parallel_size}")
    if v.data_parallel_size > 1:
        parts.append(f"DP{v.data_parallel_size}")
    if v.enable_expert_parallel:
        parts.append("EP")
    if v.decode_context_parallel_size > 1:
        parts.append(f"DCP{v.decode_context_parallel_size}")
    return "+".join(parts)


@click.command(epilog=exit_codes("0 ok, 2 a manifest is invalid (the valid ones are still listed)."))
@json_option("Print a JSON list instead of a table.")
@pass_app
def models(app, as_json):
    """List the deployable models (the manifests in the models folder).

    \b
    Example:
      vllm-orch models
      vllm-orch --models ./my-models models --json
    """
    from orchestrator.config.manifest import load_all
    from orchestrator.fmt import escape

    folder = resolved_models_dir(app)
    good, bad = load_all(folder)
    rows: list[dict[str, Any]] = [
        {"name": m.name, "repo": m.source.repo, "revision": m.source.revision,
         "bytes": m.source.expected_bytes, "gpus": m.serving.gpus,       # per node
         "nodes": m.multinode.nodes if m.multinode else 1,
         "parallelism": parallelism(m.vllm), "port": m.serving.port,
         "served_model_name": m.served_name, "description": m.description}
        for m in good.values()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        from rich.table import Table

        console().print(f"Models in {folder}:", markup=False)
        table = Table()
        # names and repos fold on a narrow terminal; the short figures keep their width (80 columns
        # cut them to "GP…", "80…")
        for col in ("name", "repo", "size", "GPUs", "layout", "port"):
            short = col in ("size", "GPUs", "port")
            table.add_column(col, no_wrap=short, overflow="fold", min_width=7 if col == "size" else
                             len(col) if short else None)
        for r in rows:
            table.add_row(escape(str(r["name"])), escape(str(r["repo"])), _size(r["bytes"]),
                          f"{r['nodes']}x{r['gpus']}" if r["nodes"] > 1 else str(r["gpus"]),
                          r["parallelism"], str(r["port"]))
        out = console()
        from orchestrator.bench.tables import print_wide

        print_wide(out, table)
        for r in rows:
            if r["description"]:
                out.print(f"  [bold]{escape(str(r['name']))}[/]: {escape(str(r['description']))}", soft_wrap=True)
    for err in bad:
        console(stderr=True).print(f"[red]invalid:[/] {escape(str(err))}", soft_wrap=True)
    if bad:
        raise SystemExit(2)


@click.command(epilog=exit_codes("0 every file is valid, 2 a file is invalid or there is nothing to check."))
@click.argument("files", nargs=-1, type=click.Path(path_type=Path))
@pass_app
def validate(app, files):
    """Check manifests and inventories: every problem with file, line and field path.

    With no FILES, checks every manifest of the models folder, the inventory in use and the extra
    inventory files (hosts.d). A file is treated as an inventory when it has a top-level `hosts:` or `groups:` key.

    \b
    Example:
      vllm-orch validate
      vllm-orch validate models/kimi-k25-int4.yaml hosts.yaml
    """
    from orchestrator.config.inventory import extra_inventory_files, inventory_path, validate_inventory_file
    from orchestrator.config.manifest import load_manifest, manifest_files
    from orchestrator.config.yamlsrc import display_path
    from orchestrator.fmt import escape

    targets: list[tuple[str, Path]] = []
    if files:
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{f}: no such file")
            targets.append(("inventory" if _looks_like_inventory(f) else "manifest", f))
    else:
        targets += [("manifest", p) for p in manifest_files(resolved_models_dir(app))]
        inv = inventory_path(app.inventory_path)
        targets += [("inventory", p) for p in [*([inv] if inv is not None else []), *extra_inventory_files()]]
    out = console()
    failures = 0
    for kind, path in targets:
        try:
            if kind == "inventory":
                validate_inventory_file(path)
            else:
                load_manifest(path)
            out.print(f"[green]ok[/]      {escape(display_path(path))} ({kind})")
        except ConfigError as err:
            failures += 1
            out.print(f"[red]invalid[/] {escape(str(err))}", soft_wrap=True)
            for line in err.details:
                out.print(f"        {line}", soft_wrap=True, markup=False)
    if not targets:
        raise ConfigError("nothing to validate: no manifests found")
    if failures:
        out.print(f"{failures} of {len(targets)} files invalid")
        raise SystemExit(2)


def _local_gpu_names(entry) -> dict[int, str] | None:
    """A local host's GPU names (this machine's nvidia-smi, as deploy reads them), so that `render`
    shows the flags its hardware class gives, the flags deploy installs; None for a remote host (not
    contacted: --hardware CLASS shows a class) or when nvidia-smi cannot be read."""
    if not entry.is_local:
        return None
    from orchestrator.errors import OrchestratorError
    from orchestrator.host.connect import open_host
    from orchestrator.host.ownership import read_gpus

    try:
        with open_host(entry) as host:
            gpus, _ = read_gpus(host, entry)
    except (OrchestratorError, OSError):
        return None
    return {g.index: g.name for g in gpus if g.index is not None and g.name} or None


def _looks_like_inventory(path: Path) -> bool:
    from orchestrator.config.yamlsrc import YamlDoc

    try:
        data = YamlDoc(path, str(path)).data       # the same guarded reading as the real load
    except ConfigError:
        return False                               # loaded as a manifest, which reports the problem
    # An inventory's top-level keys are its fields (`hosts`, `groups`): a file of groups alone, for
    # hosts written in another file, is an inventory too (it was read as a manifest).
    from orchestrator.config.inventory import Inventory

    return isinstance(data, dict) and bool(set(data) & set(Inventory.model_fields))


@click.command(epilog=exit_codes("0 ok, 2 bad input (unknown model or host, invalid manifest, a multi-node "
                                 "model given the wrong number of hosts)."))
@model_argument()
@host_option(required=False, help="Render for this inventory host (paths, service manager); a multi-node "
                                  "model takes one host per node, head first: --host gpu1,gpu2. Default: a "
                                  "typical systemd host with vLLM in /opt/vllm (example nodes for a "
                                  "multi-node model).")
@click.option("--hardware", "hardware", type=click.Choice(CLASS_KEYS),
              help="Render for this hardware class (on a deploy the host's GPUs pick it).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path),
              help="Write the unit, env file and argv.json into this folder instead of printing (a "
                   "multi-node model: one sub-folder per node, named after its host).")
@placement_options
@pass_app
def render(app, model, host_name, hardware, out_dir, service_name, gpus, port):
    """Show what a model becomes on a host: the systemd unit (or start script), the env file
    (secrets masked), the vLLM argv, and where each value comes from (the manifest, its
    requires.hardware entry for the class, or the host's service_env and overrides). Nothing is
    changed anywhere and a remote host is not contacted: give --hardware for a class's settings (a
    local host, such as the SIMULATED `sim`, is read: its GPUs pick the class, as deploy's do).
    A multi-node model (`multinode:` in its manifest) shows every node's files, headed by the
    node's host and rank.

    \b
    Example:
      vllm-orch render kimi-k25-int4
      vllm-orch render minimax-m25 --host gpu1 --hardware rtx-pro-6000
      vllm-orch render minimax-m25 --host gpu1 --out ./rendered
      vllm-orch render minimax-m25 --host gpu1 --gpus 4-7 --port 8001
      vllm-orch render kimi-k25-int4-2node --host gpu1,gpu2
    """
    from orchestrator.config.effective import effective
    from orchestrator.config.inventory import HostEntry
    from orchestrator.config.manifest import get_manifest
    from orchestrator.config.placement import resolve
    from orchestrator.render.artifacts import render as do_render

    manifest, _ = get_manifest(model, resolved_models_dir(app))
    request = service_request(manifest, service_name, gpus, port)
    names = [n.strip() for n in (host_name or "").split(",") if n.strip()]
    mn = manifest.multinode
    if names:
        entries = [load_host_entry(app, n) for n in names]
    elif mn is not None:          # documentation addresses (RFC 5737): nothing real is named
        entries = [HostEntry(name=f"example-node{i + 1}", address=f"192.0.2.{i + 1}") for i in range(mn.nodes)]
    else:
        entries = [HostEntry(name="example-host", address="gpu-host")]
    if mn is None and len(entries) > 1:
        raise ConfigError(f"{manifest.name} runs on one host (its manifest has no multinode section) but "
                          f"{len(entries)} hosts were given: {', '.join(names)}", hint="pass one --host NAME")
    spec = resolve(manifest, entries, request)          # no host is asked: no earlier placement is known
    shown = []
    for entry in entries:
        eff = effective(manifest, entry, gpu_names=None if hardware else _local_gpu_names(entry),
                        hardware=hardware, spec=spec)
        shown.append((entry, eff, do_render(eff.manifest, entry, role=spec.role(entry.name), model=spec.model)))
    if out_dir:
        for host, _eff, r in shown:
            folder = out_dir / host.name if r.role is not None else out_dir
            _write_rendered(r, folder)
        return
    for host, eff, r in shown:
        _print_rendered(host, eff, r)


def _write_rendered(r, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for f in r.files:
        (folder / Path(f.path).name).write_text(f.text)   # masked text: secrets never leave the deploy path
    (folder / "argv.json").write_text(json.dumps(r.argv, indent=2) + "\n")
    console().print(f"wrote {', '.join(Path(f.path).name for f in r.files)}, argv.json to {folder}", markup=False)


def node_title(r) -> str:
    """`node 0 (head): gpu1` / `node 1 of 2 (headless): gpu2`, for a node's rendered files."""
    role = r.role
    kind = "head" if role.head else ("Ray worker" if not r.runs_vllm else "headless")
    return f"node {role.rank} of {len(role.nodes)} ({kind}): {role.host}"


def _print_rendered(host, eff, r) -> None:
    from rich.rule import Rule

    from orchestrator.render.artifacts import ray_unit_name
    from orchestrator.render.sources import source_lines

    out = console()
    if r.role is not None:
        out.print(Rule(f"[bold]{node_title(r)}[/]", characters="=", align="left"))
    ray = [f for f in r.extra if Path(f.path).name == ray_unit_name(r.manifest)]
    command = "vLLM argv" if r.runs_vllm else "Ray argv (vLLM runs on the head; this node joins its Ray cluster)"
    for title, text in ((r.unit.path, r.unit.text), *((f.path, f.text) for f in ray),
                        (f"{r.env_file.path} (mode 0600, secrets masked)", r.env_file.text),
                        (command, json.dumps(r.argv, indent=1) + "\n"),
                        (f"where the values come from on {host.name} (* = not the manifest's own)",
                         "\n".join(source_lines(r, eff)) + "\n")):
        out.print(Rule(title, align="left"))
        out.print(text, end="", markup=False, highlight=False, soft_wrap=True)


@click.command(epilog=exit_codes("0 ok, 2 both --hosts and --records."))
@click.option("--hosts", "for_hosts", is_flag=True, help="The inventory (hosts.yaml) schema instead.")
@click.option("--records", "for_records", is_flag=True,
              help="The schemas of the records vllm-orch keeps on a host (services/NAME.json, installed/NAME.json, "
                   "history.jsonl lines, swap.json) instead, with their version.")
def schema(for_hosts, for_records):
    """Print the JSON schema of model manifests (for editor completion and checks).

    \b
    Example:
      vllm-orch schema > manifest.schema.json
      vllm-orch schema --hosts > hosts.schema.json
      vllm-orch schema --records > records.schema.json
    """
    if for_hosts and for_records:
        raise ConfigError("--hosts and --records: give one of them")
    if for_records:
        from orchestrator.host.records import record_schemas

        click.echo(json.dumps(record_schemas(), indent=2))
    elif for_hosts:
        from orchestrator.config.inventory import inventory_schema

        click.echo(json.dumps(inventory_schema(), indent=2))
    else:
        from orchestrator.config.manifest import manifest_schema

        click.echo(json.dumps(manifest_schema(), indent=2))


@click.command(epilog=exit_codes("0 ok, 2 an inventory file is invalid."))
@json_option("Print JSON.")
@click.option("--example", is_flag=True,
              help="Print the commented example inventory (hosts.example.yaml, shipped in the package) "
                   "and exit: a start for your hosts.yaml.")
@pass_app
def hosts(app, as_json, example):
    """List the hosts of the inventory: yours, plus those of the extra inventory files (hosts.d),
    such as the SIMULATED ones of `vllm-orch sim up`.

    \b
    Example:
      vllm-orch hosts
      vllm-orch hosts --example > hosts.yaml     # then edit it
    """
    from orchestrator.config.inventory import NO_INVENTORY_HINT, load_inventory

    if example:
        from orchestrator.paths import example_inventory

        click.echo(example_inventory().read_text(), nl=False)
        return
    inv = load_inventory(app.inventory_path)
    if as_json:
        click.echo(json.dumps([h.model_dump() for h in inv.hosts.values()], indent=2))
        return
    if not inv.hosts:
        console().print(f"No hosts: {NO_INVENTORY_HINT}.", markup=False)
        return
    from rich.table import Table

    from orchestrator.fmt import escape

    table = Table()
    for col in ("host", "address", "service manager", "models root", "vllm"):
        table.add_column(col, overflow="fold")      # paths fold on a narrow terminal, never cut
    for h in inv.hosts.values():
        table.add_row(escape(h.display_name), escape(h.address), h.service_manager, escape(h.models_root),
                      escape(h.vllm))
    from orchestrator.bench.tables import print_wide

    print_wide(console(), table)
