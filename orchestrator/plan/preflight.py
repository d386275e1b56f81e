"""Preflight checks: catch what would kill a vLLM service AFTER a 28-minute download and during a
36-minute load, before anything is downloaded or stopped.

Every function here is pure: plain data in (what argcheck.py / inspect_env.py / nvidia-smi reported,
what the manifest needs), one `Check` out. Gathering the data from a host is orchestrator.ops.gather's job.
A failing Check names what is wrong, the numbers, and the fix; `field` names the manifest field to
edit when one is to blame.

Check names (for `--skip-check NAME`): see CHECK_NAMES. A skipped check is still returned, with
status "skipped", so the plan shows that the user chose to skip it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

from orchestrator.host.nvidia_smi import Gpu
from orchestrator.host.ownership import Holders
from orchestrator.plan.envnames import consumer_of
from orchestrator.plan.traps import TRAPS, flag_value, springs
from orchestrator.plan.versions import public_version, version_key

OK, WARN, FAIL, SKIPPED = "ok", "warn", "fail", "skipped"

CHECK_NAMES = ("flags", "env", "service-user", "root-programs", "root-folders", "vllm-version", "version-traps",
               "package-pairs", "torch-cuda", "required-packages", "gpus", "foreign-gpu-processes")


@dataclass
class Check:
    name: str
    status: str                       # ok | warn | fail | skipped
    summary: str                      # one line, the numbers included
    details: list[str] = dc_field(default_factory=list)
    fix: str | None = None
    field: str | None = None          # manifest field to edit, e.g. "vllm.extra_args[0]"
    seconds: float | None = None      # time to gather + check (set by the runner)

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "summary": self.summary,
                "details": list(self.details), "fix": self.fix, "field": self.field,
                "seconds": self.seconds}


def skippable(name: str) -> Callable:
    """Decorator: `skip=` containing `name` returns a "skipped" Check instead of running it."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, skip: Collection[str] = (), **kwargs) -> Check:
            if name in skip:
                return Check(name, SKIPPED, f"skipped (--skip-check {name})")
            return fn(*args, **kwargs)
        inner.check_name = name  # type: ignore[attr-defined]
        return inner
    return wrap


# -- the service user -----------------------------------------------------------------------------
@skippable("service-user")
def check_service_user(reach: Mapping[str, Any] | None) -> Check:
    """The service user must be able to run the vllm executable: a venv in a private home (/root,
    /home/alice, both 0700) works for whoever installed it and fails only when the unit starts -
    after the download. `reach`: the host facts' answer (facts_script.service_reach)."""
    name = "service-user"
    if reach is None:
        return Check(name, OK, "not checked (the host facts do not say who runs the service)")
    user, vllm = reach.get("user", "?"), reach.get("path", "vllm")
    if user == "root":
        return Check(name, OK, f"the service runs as root: it can run {vllm}")
    problems, unchecked = list(reach.get("problems") or []), list(reach.get("unchecked") or [])
    who = user if reach.get("exists") else f"{user} (to be created: judged by the 'other' permission bits)"
    if problems:
        return Check(name, FAIL, f"the service user {who} cannot run {vllm}: {problems[0]}",
                     details=problems + [f"not checked: {u}" for u in unchecked],
                     fix=f"install vLLM where {user} can reach it (e.g. /opt/vllm), let it through "
                         f"(`chmod o+x` on the folders, `chmod o+rx` on the file), or set the "
                         f"inventory's `service_user` to the user that owns the venv")
    if unchecked:
        return Check(name, WARN, f"could not check that {who} can run {vllm}: {unchecked[0]}",
                     details=[f"not checked: {u}" for u in unchecked])
    return Check(name, OK, f"{who} can run {vllm}")


# -- what root runs and writes ---------------------------------------------------------------------
def _trust(name: str, what: str, rows: Sequence[Mapping[str, Any]] | None, fix: str) -> Check:
    """`what`: the kind of path, in the plural (`programs vllm-orch runs as root`)."""
    if rows is None:
        return Check(name, OK, "not checked (the host facts do not say)")
    bad = [r for r in rows if r.get("problem")]
    if bad:
        return Check(name, FAIL, f"another user could change one of the {what}: {bad[0]['problem']}",
                     details=[r["problem"] if r["problem"].startswith(r["path"]) else f"{r['path']}: {r['problem']}"
                              for r in bad], fix=fix)
    return Check(name, OK, f"only root can change the {what}")


@skippable("root-programs")
def check_root_programs(trust: Mapping[str, Any] | None) -> Check:
    """vllm-orch runs the host's Python (every helper, the units' root-run parts), nvidia-smi (and
    vLLM when the service runs as root) as root: a user who can change one of them, or a folder
    on the Python's sys.path, or what sits at the top of its site-packages (a `.pth` file runs at
    every start), gets root. facts_script.root_trust reads the owners and modes on the host."""
    return _trust("root-programs", "programs vllm-orch runs as root", (trust or {}).get("programs")
                  if trust is not None else None,
                  "make them root's and not writable by group or others (`chown -R root:root`, "
                  "`chmod -R go-w`), or point the inventory's `python` / `nvidia_smi` at copies that are")


def check_dev_guard(trust: Mapping[str, Any] | None, guarded: bool = True) -> Check:
    """Sleep mode (VLLM_SERVER_DEV_MODE=1) opens /sleep, /wake_up, /collective_rpc outside vLLM's
    --api-key; the service's start installs an nftables table that keeps every local user but root
    and the service user out (render/artifacts.py dev_guard_rules), so the host needs nft. Not
    skippable: without it the start fails (the endpoints are never open unguarded)."""
    if not guarded:
        return Check("dev-guard", WARN, "sleep mode's dev-mode endpoints (/sleep, /wake_up, /collective_rpc) are "
                                        "open to every local user of this host (inventory dev_guard: false)",
                     fix="set dev_guard: true (the default) on a host shared with other users; it needs root and nft")
    if trust is None:
        return Check("dev-guard", OK, "not checked (the host facts do not say)")
    if not trust.get("nft"):
        return Check("dev-guard", FAIL, "sleep mode needs nft on the host (the nftables guard of the dev-mode "
                                        "endpoints /sleep, /wake_up, /collective_rpc): it is not installed",
                     fix="install nftables (Debian/Ubuntu: apt-get install nftables), or drop `sleep:`")
    return Check("dev-guard", OK, f"{trust['nft']} guards the dev-mode endpoints (root and the service user only)")


@skippable("root-folders")
def check_root_folders(trust: Mapping[str, Any] | None) -> Check:
    """The folders vllm-orch writes as root (models_root, state_dir, env_dir, units_dir, log_dir,
    the probe's bin/): a user who can change one of them, or a folder above it, can swap a part for
    a symlink and have root write (or delete) elsewhere. /tmp-like folders (sticky, writable by
    everyone) are trusted only above a part root already made."""
    return _trust("root-folders", "folders vllm-orch writes as root", (trust or {}).get("folders")
                  if trust is not None else None,
                  "use folders that only root can change, e.g. under /var/lib/vllm-orch, or make them "
                  "root's (`chown root:root`, `chmod go-w`) on the way from /")


# -- versions ---------------------------------------------------------------------------------------
@skippable("vllm-version")
def check_vllm_version(installed: str | None, minimum: str | None, *, python: str = "",
                       field: str = "requires.min_vllm_version") -> Check:
    where = f" for {python}" if python else ""
    if not installed:
        return Check("vllm-version", FAIL, f"vLLM is not installed{where}",
                     fix="install vLLM into the host's Python, or set the inventory's `python:` to "
                         "the Python of the vLLM installation")
    if minimum and version_key(installed) < version_key(minimum):
        return Check("vllm-version", FAIL,
                     f"vLLM {installed} is older than the manifest's minimum {minimum}",
                     details=[f"installed: vllm {installed}{where}", f"required: >= {minimum}"],
                     fix=f"pip install -U 'vllm>={minimum}' on the host (or deploy a model whose "
                         f"minimum is <= {installed})", field=field)
    return Check("vllm-version", OK, f"vLLM {installed}" + (f" >= {minimum}" if minimum else ""))


@skippable("version-traps")
def check_traps(installed: str | None, argv: Sequence[str],
                provenance: Sequence[tuple[str, str]] = ()) -> Check:
    """Flag combinations this vLLM accepts and then dies of, late (orchestrator/plan/traps.py)."""
    if not installed:
        return Check("version-traps", SKIPPED, "skipped: the vLLM version is not known")
    hits = springs(installed, argv)
    if not hits:
        return Check("version-traps", OK, f"none of the {len(TRAPS)} known version traps applies to vLLM "
                                          f"{installed} with these flags")
    trap, tokens = hits[0]
    fld, _ = field_for([t.split(" ")[0] for t in tokens], provenance)
    details = []
    for t, toks in hits:
        details += [f"{t.what}: {' + '.join(toks)} on vLLM {installed} (fixed in {t.fixed_in})",
                    f"  it dies {t.when} with: {t.symptom}",
                    f"  checked: {t.evidence}",
                    f"  sources: {', '.join(t.sources)}"]
    return Check("version-traps", FAIL,
                 f"vLLM {installed} accepts {' + '.join(tokens)} and then dies {trap.when}",
                 details=details, fix=trap.fix, field=fld or trap.fields[0])


# Pairs that must be installed at the very same version. The left one is the reference.
PACKAGE_PAIRS = (("flashinfer-python", "flashinfer-cubin"), ("flashinfer-python", "flashinfer-jit-cache"))


def flashinfer_error_text(cubin: str, flashinfer: str, other: str = "flashinfer-cubin") -> str:
    """The start-up error FlashInfer raises (vllm-project/vllm#49804)."""
    return (f"RuntimeError: {other} version ({cubin}) does not match flashinfer version "
            f"({flashinfer}). Please install the same version of both packages. "
            "Set FLASHINFER_DISABLE_VERSION_CHECK=1 to bypass this check.")


@skippable("package-pairs")
def check_package_pairs(versions: Mapping[str, str | None],
                        env: Mapping[str, str] | None = None) -> Check:
    mismatched, compared = [], []
    for ref, other in PACKAGE_PAIRS:
        a, b = versions.get(ref), versions.get(other)
        if not a or not b:
            continue
        compared.append(f"{other} {b} = {ref} {a}")
        if public_version(a) != public_version(b):
            mismatched.append((ref, a, other, b))
    if not mismatched:
        if not compared:
            return Check("package-pairs", OK, "no flashinfer companion packages installed")
        return Check("package-pairs", OK, "; ".join(compared))
    bypass = (env or {}).get("FLASHINFER_DISABLE_VERSION_CHECK") == "1"
    ref, a, other, b = mismatched[0]
    details = [f"{o} {vb} != {r} {va}" for r, va, o, vb in mismatched]
    details.append("vLLM would die at start-up with: "
                   + flashinfer_error_text(public_version(b), public_version(a), other))
    fix = " ; ".join(f"pip install '{o}=={public_version(va)}'" for r, va, o, vb in mismatched) \
        + f" (the same version as {ref})"
    if bypass:
        return Check("package-pairs", WARN,
                     f"{other} {b} != {ref} {a}, but FLASHINFER_DISABLE_VERSION_CHECK=1 bypasses "
                     "FlashInfer's check", details=details, fix=fix)
    return Check("package-pairs", FAIL, f"{other} {b} does not match {ref} {a}", details=details,
                 fix=fix)


def _cuda_tuple(v: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


# Minimum Linux driver branch per CUDA release (NVIDIA CUDA toolkit release notes, GA drivers).
DRIVER_FOR_CUDA = {(13, 0): "580", (12, 9): "575", (12, 8): "570", (12, 6): "560", (12, 4): "550"}


@skippable("torch-cuda")
def check_torch_cuda(torch_cuda: str | None, driver_cuda: str | None, *,
                     torch_version: str | None = None, driver_version: str | None = None) -> Check:
    """torch built for CUDA X.Y needs a driver supporting >= X.Y (nvidia-smi's "CUDA Version" is the
    newest CUDA the driver supports)."""
    tv = f"torch {torch_version}" if torch_version else "torch"
    if not torch_version and not torch_cuda:
        return Check("torch-cuda", FAIL, "torch is not installed in the host's Python",
                     fix="install vLLM with its dependencies (pip install vllm) in that Python")
    if not torch_cuda:
        return Check("torch-cuda", FAIL, f"{tv} is not a CUDA build: vLLM cannot use the GPUs",
                     fix="install the CUDA build of torch that your vLLM pins")
    if not driver_cuda:
        return Check("torch-cuda", WARN, f"{tv} is built for CUDA {torch_cuda}; the driver's CUDA "
                     "version is unknown (nvidia-smi did not show it)",
                     fix="check that nvidia-smi works on the host")
    need, have = _cuda_tuple(torch_cuda), _cuda_tuple(driver_cuda)
    drv = f"driver {driver_version}" if driver_version else "the driver"
    if need and have and need > have:
        branch = DRIVER_FOR_CUDA.get(need)
        return Check("torch-cuda", FAIL,
                     f"{tv} is built for CUDA {torch_cuda} but {drv} supports CUDA <= {driver_cuda}",
                     details=[f"torch CUDA build: {torch_cuda}",
                              f"nvidia-smi 'CUDA Version' (newest the driver supports): {driver_cuda}"],
                     fix=f"upgrade the NVIDIA driver to one supporting CUDA {torch_cuda}"
                         + (f" (R{branch} or newer)" if branch else "")
                         + f", or install a vLLM/torch build for CUDA <= {driver_cuda}")
    return Check("torch-cuda", OK, f"{tv} (CUDA {torch_cuda}) runs on {drv} (CUDA {driver_cuda})")


# -- what the argv needs ------------------------------------------------------------------------------
def packages_needed(argv: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Python packages the service will import because of its flags/env: {package: why}."""
    env = env or {}
    needs: dict[str, str] = {}
    if (flag_value(argv, "--load-format") or "") == "fastsafetensors":
        needs["fastsafetensors"] = "--load-format fastsafetensors (vLLM crashes without the package)"
    backend = (flag_value(argv, "--attention-backend") or "").upper()
    if backend.startswith("FLASHINFER"):
        needs["flashinfer-python"] = f"--attention-backend {backend}"
    moe = (flag_value(argv, "--moe-backend") or "").lower()
    if moe.startswith("flashinfer"):
        needs["flashinfer-python"] = f"--moe-backend {moe}"
    if env.get("VLLM_USE_FLASHINFER_MOE_FP4") == "1":
        needs["flashinfer-python"] = "VLLM_USE_FLASHINFER_MOE_FP4=1"
    return needs


@skippable("required-packages")
def check_required_packages(needs: Mapping[str, str], versions: Mapping[str, str | None]) -> Check:
    """needs: {package: why} (packages_needed() or the manifest); versions: inspect_env's packages."""
    missing = {p: why for p, why in needs.items() if not versions.get(p)}
    if missing:
        return Check("required-packages", FAIL,
                     "missing Python package" + ("s" if len(missing) > 1 else "") + ": "
                     + ", ".join(missing),
                     details=[f"{p}: needed for {why}" for p, why in missing.items()],
                     fix="pip install " + " ".join(missing) + " into the host's vLLM Python")
    if not needs:
        return Check("required-packages", OK, "no extra packages needed")
    return Check("required-packages", OK,
                 ", ".join(f"{p} {versions.get(p)}" for p in needs))


# -- flags --------------------------------------------------------------------------------------------
# Removed or renamed flags -> the fix. vLLM changes behind them: PR #17452 (--enable-reasoning), #21739
# and #29402 (--disable-log-requests), #22772 (--guided-decoding-*); swap_space left EngineArgs in 0.18.0.
FLAG_FIXES = {
    "--enable-reasoning": "remove --enable-reasoning: --reasoning-parser NAME alone enables reasoning "
                          "(deprecated in 0.8.5, rejected since 0.10)",
    "--disable-log-requests": "drop --disable-log-requests: request logging is off by default "
                              "(opt in with --enable-log-requests)",
    "--guided-decoding-backend": "use --structured-outputs-config.backend NAME (all "
                                 "--guided-decoding-* options were removed)",
    "--swap-space": "drop --swap-space: swap_space was removed from vLLM's engine args in 0.18.0",
}
ENV_FIXES = {
    "VLLM_ATTENTION_BACKEND": "use the flag --attention-backend NAME instead of the "
                              "VLLM_ATTENTION_BACKEND env var",
    "VLLM_FLASHINFER_MOE_BACKEND": "use the flag --moe-backend flashinfer_trtllm|flashinfer_cutlass|"
                                   "flashinfer_cutedsl instead of VLLM_FLASHINFER_MOE_BACKEND",
}


def _norm(token: str) -> str:
    """Compare argv tokens the way vLLM's parser does: --a_b=1 and --a-b match."""
    if not token.startswith("-"):
        return token
    key = token.split("=", 1)[0]
    head, dot, rest = key.partition(".")
    return head.replace("_", "-") + dot + rest


def field_for(bad_args: Iterable[str], provenance: Sequence[tuple[str, str]]) -> tuple[str | None, str | None]:
    """(field, token): the manifest field that produced the first bad argv token it knows about."""
    by_token: dict[str, str] = {}
    for tok, fld in provenance:
        by_token.setdefault(_norm(tok), fld)
    bad = list(bad_args)
    for tok in [t for t in bad if t.startswith("-")] + [t for t in bad if not t.startswith("-")]:
        if _norm(tok) in by_token:
            return by_token[_norm(tok)], tok
    return None, (bad[0] if bad else None)


def fix_for_flag(token: str | None) -> str | None:
    if not token:
        return None
    key = _norm(token)
    if key in FLAG_FIXES:
        return FLAG_FIXES[key]
    if key.startswith("--guided-decoding"):
        return FLAG_FIXES["--guided-decoding-backend"]
    return None


REUSED = "vLLM's parser: answered earlier for the same command line and venv"


@skippable("flags")
def check_flags(argcheck_result: Mapping[str, Any], provenance: Sequence[tuple[str, str]], *,
                manifest: str | None = None, reused: bool = False) -> Check:
    """argcheck_result: argcheck.py's JSON; provenance: [(argv_token, manifest field)] from render.
    `reused`: the answer an engine venv kept for this very command line and venv (not asked now)."""
    r = argcheck_result
    version = r.get("vllm_version") or "?"
    where = f"{manifest}: " if manifest else ""
    if r.get("stage") in ("import", "request"):
        return Check("flags", FAIL, f"could not build vLLM's argument parser on the host: {r.get('error')}",
                     fix="check that the inventory's `python:` is the Python of the host's vLLM")
    if not r.get("ok"):
        error = r.get("error") or "?"
        bad = list(r.get("bad_args") or [])
        fld, token = field_for(bad, provenance)
        summary = f"{where}{fld + ': ' if fld else ''}vLLM {version} rejects it: {error}"
        details = []
        if r.get("error_line"):
            details.append(r["error_line"])
        for tok in bad:
            f2, _ = field_for([tok], provenance)
            if f2:
                details.append(f"{tok}: from {f2}")
        fixes = [f for f in (fix_for_flag(t) for t in bad) if f]
        fix = "; ".join(dict.fromkeys(fixes)) or (
            f"edit {fld}" if fld else "edit the manifest's vllm flags") + \
            f" (see `vllm serve --help=all` for vLLM {version})"
        return Check("flags", FAIL, summary, details=details, fix=fix, field=fld)
    deprecated = list(r.get("deprecated") or [])
    if deprecated:
        details = []
        first_field = None
        for d in deprecated:
            fld, _ = field_for([d["arg"]] if d.get("arg") else [], provenance)
            first_field = first_field or fld
            details.append(f"{where}{fld + ': ' if fld else ''}{d.get('arg') or ''}: {d['message']}")
        args = ", ".join(d["arg"] for d in deprecated if d.get("arg"))
        fixes = [f for f in (fix_for_flag(d.get("arg")) for d in deprecated) if f]
        return Check("flags", WARN, f"vLLM {version} accepts the command line but deprecates {args}",
                     details=details + ([REUSED] if reused else []),
                     fix="; ".join(fixes) or "replace or drop the deprecated arguments", field=first_field)
    if reused:
        return Check("flags", OK, f"{REUSED} (vLLM {version} accepts it; --verify-engine asks it again)")
    seconds = r.get("seconds")
    return Check("flags", OK, f"vLLM {version} parser accepts the command line"
                 + (f" ({seconds:.1f} s)" if isinstance(seconds, (int, float)) else ""))


@skippable("env")
def check_env(env: Mapping[str, str], unknown_env: Iterable[str] = (), *,
              env_fields: Mapping[str, str] | None = None, not_read: Iterable[str] = ()) -> Check:
    """Environment the service gets, against what reads it. `unknown_env` (argcheck): VLLM_* names
    the host's vLLM does not read - renamed into flags (VLLM_ATTENTION_BACKEND since 0.26, a
    failure: the setting is lost) or misspelt (a warning). `not_read` (argcheck): other names vLLM
    does not read; a warning unless a library vLLM runs on reads them (plan/envnames.py)."""
    unknown, ignored = set(unknown_env), set(not_read)
    env_fields = env_fields or {}
    fails, warns = [], []
    for name in env:
        fld = env_fields.get(name, f"env.{name}")
        if name in ENV_FIXES and name in unknown:
            fails.append((name, fld, f"{fld}: this vLLM ignores {name}; {ENV_FIXES[name]}"))
        elif name in ENV_FIXES:
            warns.append((name, fld, f"{fld}: {name} is deprecated; {ENV_FIXES[name]}"))
        elif name in unknown:
            warns.append((name, fld, f"{fld}: this vLLM does not read {name} (misspelt or removed?)"))
        elif name in ignored and consumer_of(name) is None:
            warns.append((name, fld, f"{fld}: nothing reads {name}: not this vLLM, nor NCCL, CUDA, torch, "
                                     "Hugging Face, FlashInfer or Triton (a setting for another engine?)"))
    if fails:
        return Check("env", FAIL, f"{fails[0][2]}", details=[x[2] for x in fails + warns],
                     fix=ENV_FIXES[fails[0][0]], field=fails[0][1])
    if warns:
        return Check("env", WARN, warns[0][2], details=[x[2] for x in warns],
                     fix=ENV_FIXES.get(warns[0][0], f"remove {warns[0][0]} or fix its name"),
                     field=warns[0][1])
    return Check("env", OK, f"{len(env)} variables, each read by this vLLM or a library it runs on"
                 if env else "no service environment to check")


# -- hardware -----------------------------------------------------------------------------------------
@dataclass
class GpuNeeds:
    """What the manifest asks of the host's GPUs."""

    count: int
    name_contains: str | None = None          # e.g. "RTX PRO 6000"
    min_vram_mib: int | None = None           # per GPU
    indices: list[int] | None = None          # the GPUs the service will use (CUDA_VISIBLE_DEVICES)
    hardware: str | None = None               # which hardware class applied (config/effective.py)
    hardware_problem: str | None = None       # the GPUs are of a class the manifest does not run on


@skippable("gpus")
def check_gpus(gpus: Sequence[Gpu], needs: GpuNeeds) -> Check:
    """gpus: as nvidia-smi reports them (orchestrator.host.nvidia_smi.Gpu)."""
    if not gpus:
        return Check("gpus", FAIL, f"no GPU visible (nvidia-smi lists none); {needs.count} needed",
                     fix="check the NVIDIA driver (nvidia-smi) on the host")
    chosen = [g for g in gpus if needs.indices is None or g.index in needs.indices]
    problems = []
    if len(gpus) < needs.count:
        problems.append(f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} available, "
                        f"{needs.count} needed")
    if needs.indices is not None:
        absent = sorted(set(needs.indices) - {g.index for g in gpus})
        if absent:
            problems.append(f"GPU index {', '.join(map(str, absent))} does not exist "
                            f"(the host has {len(gpus)}: 0-{len(gpus) - 1})")
    if len(chosen) < needs.count and len(gpus) >= needs.count and not problems:
        problems.append(f"{len(chosen)} of the chosen GPUs exist, {needs.count} needed")
    if needs.name_contains:
        wrong = [g for g in chosen if needs.name_contains.lower() not in (g.name or "").lower()]
        if wrong:
            problems.append(f"GPU {wrong[0].index} is a {wrong[0].name}, the manifest needs "
                            f"'{needs.name_contains}'" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    if needs.hardware_problem:
        problems.append(needs.hardware_problem)
    if needs.min_vram_mib:
        small = [g for g in chosen if (g.memory_total_mib or 0) < needs.min_vram_mib]
        if small:
            problems.append(f"GPU {small[0].index} has {small[0].memory_total_mib} MiB, "
                            f"{needs.min_vram_mib} MiB per GPU needed")
    desc = f"{len(chosen)}x {chosen[0].name if chosen else '?'}"
    if problems:
        hw = problems[0] == needs.hardware_problem
        return Check("gpus", FAIL, problems[0], details=problems + [f"host: {len(gpus)}x {gpus[0].name}"
                                                                     f", {gpus[0].memory_total_mib} MiB each"],
                     fix=("deploy onto a host of a class the manifest names, or add the class to its "
                          "requires.hardware with what the model needs there") if hw else
                         ("deploy onto a host with enough matching GPUs, or change the manifest's "
                          "GPU requirements (tensor/data parallel size)"),
                     field="requires.hardware" if hw else "gpus")
    return Check("gpus", OK, f"{desc}, {min(g.memory_total_mib or 0 for g in chosen)} MiB each "
                 f"({needs.count} needed)" + (f"; {needs.hardware}" if needs.hardware else ""))


@skippable("foreign-gpu-processes")
def check_foreign_gpu_processes(held: Holders, gpu_indices: Collection[int], *,
                                kill_foreign: bool = False) -> Check:
    """held: the target GPUs' processes sorted by orchestrator.host.ownership (the same rule the
    GPU step acts on). What a dead service left and unmanaged vLLM processes are leftovers the
    deploy stops; anything else no managed service owns is refused unless --kill-foreign."""
    target = [p for p in held.kill + held.foreign if p.gpu_index is not None]
    plural = "s" if len(gpu_indices) != 1 else ""
    if not target:
        return Check("foreign-gpu-processes", OK,
                     f"no foreign process on GPU{plural} {','.join(map(str, sorted(gpu_indices)))}")
    details = [p.describe() for p in target]
    strangers = [p for p in held.foreign if p.gpu_index is not None and (not kill_foreign or not p.killable)]
    if strangers:
        s = strangers[0]
        return Check("foreign-gpu-processes", FAIL,
                     f"{len(strangers)} process{'es' if len(strangers) > 1 else ''} vllm-orch does not "
                     f"manage on the target GPUs (pid {s.pid} {s.name} on GPU {s.gpu_index})",
                     details=details,
                     fix="stop them yourself" + (", or pass --kill-foreign to let the deploy stop them"
                                                 if all(p.killable for p in strangers) else
                                                 " (vllm-orch never signals a process it cannot identify)"))
    return Check("foreign-gpu-processes", WARN,
                 f"{len(target)} leftover GPU process{'es' if len(target) > 1 else ''} on the target "
                 "GPUs; the deploy stops them (SIGTERM, then SIGKILL) before starting",
                 details=details)


def worst(checks: Iterable[Check]) -> str:
    """The overall status: fail > warn > ok (skipped counts as ok)."""
    order = {FAIL: 3, WARN: 2, OK: 1, SKIPPED: 0}
    statuses = [c.status for c in checks]
    return max(statuses, key=lambda s: order[s]) if statuses else OK


# -- evaluating everything at once ---------------------------------------------------------------------
@dataclass
class HostAnswer:
    """What one host-side script answered: its JSON (None when it printed none) and how it ran."""

    value: dict | None
    exit_code: int = 0
    tail: list[str] = dc_field(default_factory=list)     # last stderr/stdout lines, for failures
    seconds: float | None = None
    reused: bool = False        # the answer an engine venv kept for the same request and venv (not asked now)

    @classmethod
    def of(cls, value: dict | None, result: Any) -> HostAnswer:
        """From a script's JSON answer and its Result (host/scripts.run_json)."""
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        return cls(value=value, exit_code=result.exit_code, tail=tail, seconds=round(result.duration, 3))


@dataclass
class PreflightFacts:
    """What preflight reads off a host (orchestrator.ops.gather), before any check is made.
    `packages`: inspect_env.py's answer; `argcheck`: argcheck.py's (None when not asked);
    the GPU part comes from the host facts (nvidia-smi) already read for the plan."""

    python: str
    packages: HostAnswer | None
    argcheck: HostAnswer | None
    gpus: list[Gpu] | None                      # None: nvidia-smi failed (gpu_error says why)
    service_reach: dict | None = None           # can the service user run vllm (host facts)
    root_trust: dict | None = None              # who could change what root runs and writes (host facts)
    gpu_error: str | None = None
    driver_version: str | None = None
    driver_cuda: str | None = None
    gpu_seconds: float | None = None


@dataclass
class PreflightNeeds:
    """What the manifest asks for, as the checks take it."""

    argv: Sequence[str]
    provenance: Sequence[tuple[str, str]]
    env: Mapping[str, str]                      # the service's plain (non-secret) environment
    manifest_label: str | None = None
    env_fields: Mapping[str, str] | None = None
    min_vllm: str | None = None
    min_vllm_field: str = "requires.min_vllm_version"
    gpu_needs: GpuNeeds | None = None
    required_packages: Mapping[str, str] | None = None
    dev_guard: bool = False                     # sleep mode: the start installs an nftables guard (nft)
    dev_guard_on: bool = True                   # the host's inventory dev_guard (false: said, not installed)


def _broken(name: str, what: str, python: str, answer: HostAnswer) -> Check:
    return Check(name, FAIL, f"could not run {what} with {python} (exit {answer.exit_code})"
                 + (f": {answer.tail[-1]}" if answer.tail else ""), details=list(answer.tail),
                 fix="check the inventory's `python:` (the Python of the host's vLLM)",
                 seconds=answer.seconds)


def _timed(check: Check, seconds: float | None) -> Check:
    if check.status != SKIPPED:
        check.seconds = seconds
    return check


def evaluate(pf: PreflightFacts, needs: PreflightNeeds, held: Holders | None, *,
             kill_foreign: bool = False, skip: Collection[str] = ()) -> list[Check]:
    """Every preflight check, in plan order: flags, env, service-user, vllm-version, version-traps,
    package-pairs, torch-cuda, required-packages, gpus, foreign-gpu-processes. Pure: pf holds what the host answered.
    `held`: the target GPUs' processes (None: the GPU checks are not made)."""
    skip = set(skip)
    checks: list[Check] = []
    if pf.argcheck is None:
        checks += [check_flags({}, (), skip=skip), check_env({}, skip=skip)]
    elif pf.argcheck.value is None:
        checks.append(_broken("flags", "argcheck.py", pf.python, pf.argcheck))
    else:
        checks.append(_timed(check_flags(pf.argcheck.value, needs.provenance, manifest=needs.manifest_label,
                                         reused=pf.argcheck.reused, skip=skip), pf.argcheck.seconds))
        checks.append(_timed(check_env(needs.env, pf.argcheck.value.get("unknown_env") or (),
                                       env_fields=needs.env_fields, skip=skip,
                                       not_read=pf.argcheck.value.get("not_read_env") or ()),
                             pf.argcheck.seconds))
    checks.append(check_service_user(pf.service_reach, skip=skip))
    checks.append(check_root_programs(pf.root_trust, skip=skip))
    checks.append(check_root_folders(pf.root_trust, skip=skip))
    if needs.dev_guard:
        checks.append(check_dev_guard(pf.root_trust, needs.dev_guard_on))
    if pf.packages is None or pf.packages.value is None:
        if pf.packages is not None:
            checks.append(_broken("vllm-version", "inspect_env.py", pf.python, pf.packages))
        else:
            checks += [Check(n, SKIPPED, f"skipped (--skip-check {n})") for n in
                       ("vllm-version", "version-traps", "package-pairs", "torch-cuda", "required-packages")]
    else:
        info, t = pf.packages.value, pf.packages.seconds
        pk = info.get("packages", {})
        required = {**packages_needed(needs.argv, needs.env), **(needs.required_packages or {})}
        for c in (check_vllm_version(pk.get("vllm"), needs.min_vllm, python=pf.python,
                                     field=needs.min_vllm_field, skip=skip),
                  check_traps(pk.get("vllm"), needs.argv, needs.provenance, skip=skip),
                  check_package_pairs(pk, needs.env, skip=skip),
                  check_torch_cuda(info.get("torch_cuda"), pf.driver_cuda, torch_version=pk.get("torch"),
                                   driver_version=pf.driver_version, skip=skip),
                  check_required_packages(required, pk, skip=skip)):
            checks.append(_timed(c, t))
    if needs.gpu_needs is not None and held is not None:
        if pf.gpus is None:
            for name in ("gpus", "foreign-gpu-processes"):
                checks.append(Check(name, SKIPPED, f"skipped (--skip-check {name})") if name in skip else
                              Check(name, FAIL, f"nvidia-smi failed: {pf.gpu_error or '?'}",
                                    fix="check the NVIDIA driver; nvidia-smi is the inventory's `nvidia_smi`"))
        else:
            targets = needs.gpu_needs.indices if needs.gpu_needs.indices is not None else \
                [g.index for g in pf.gpus if g.index is not None][:needs.gpu_needs.count]
            checks.append(_timed(check_gpus(pf.gpus, needs.gpu_needs, skip=skip), pf.gpu_seconds))
            checks.append(_timed(check_foreign_gpu_processes(held, targets, kill_foreign=kill_foreign,
                                                             skip=skip), pf.gpu_seconds))
    return checks


def needs_for(manifest: Any, argv: Sequence[str], provenance: Sequence[tuple[str, str]],
              manifest_label: str | None = None, effective: Any = None, dev_guard_on: bool = True) -> PreflightNeeds:
    """PreflightNeeds from a Manifest (orchestrator.config.manifest) and its rendered argv;
    `effective` (orchestrator.config.effective.Effective) says which hardware class applied and
    where each environment variable comes from (the manifest, its class, the host); `dev_guard_on`:
    the host's inventory `dev_guard`."""
    from orchestrator.secret import Secret

    vram = getattr(manifest.requires, "vram_per_gpu_gib", 0) or 0
    env = {k: str(v) for k, v in dict(manifest.env).items() if not isinstance(v, Secret)}
    origins = effective.origins if effective is not None else {}
    env_fields = {}
    for name in env:
        origin = origins.get(f"env.{name}")
        env_fields[name] = (f"{origin}.env.{name}" if origin and origin.startswith("requires.")
                            else origin or f"env.{name}")
    return PreflightNeeds(
        dev_guard=getattr(manifest, "sleep", None) is not None, dev_guard_on=dev_guard_on,
        argv=list(argv), provenance=list(provenance), manifest_label=manifest_label, env=env,
        env_fields=env_fields, min_vllm=manifest.requires.min_vllm_version,
        min_vllm_field=(f"{origins['requires.min_vllm_version']}.min_vllm_version"
                        if "requires.min_vllm_version" in origins else "requires.min_vllm_version"),
        gpu_needs=GpuNeeds(count=manifest.serving.gpus, name_contains=manifest.requires.gpu_name,
                           min_vram_mib=int(vram * 1024) or None,
                           indices=list(manifest.serving.visible_devices),
                           hardware=effective.hardware_note() if effective is not None else None,
                           hardware_problem=effective.hardware_problem if effective is not None else None))
