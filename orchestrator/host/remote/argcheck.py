"""Host-side: parse a `vllm serve` argv with the host's OWN vLLM parser and report what it says.

Run by the host's vLLM Python, standard library + the installed vLLM only:

    echo '{"argv": ["serve", "org/model", "--tensor-parallel-size", "8"], "env": {}}' | python argcheck.py

The orchestrator sends this file as the program text (`python - '<json request>'`, the file on
stdin, orchestrator/host/scripts.py); then the request is the first argument instead of stdin.

Request: {"argv": [...], "env": {NAME: VALUE}}, or {"batch": [request, ...]} (answered with
{"results": [result, ...], "seconds": float}; the parser is built once). argv may be `["vllm", "serve", MODEL, ...]`,
`["serve", MODEL, ...]`, `[MODEL, --flags...]` or the flags only. env is applied before vLLM is
imported (VLLM_* variables can change defaults).

Prints exactly ONE JSON line on stdout (everything vLLM logs goes to stderr):
    {"ok": bool, "stage": "parse"|"validate"|"import"|"request"|null,
     "error": argparse's exact message ("unrecognized arguments: --enable-reasoning") or null,
     "error_line": the line vLLM prints ("vllm: error: unrecognized arguments: ...") [parse errors],
     "bad_args": [tokens of the argv the error is about],
     "deprecated": [{"arg": "--mamba-cache-mode", "message": "..."}],
     "unknown_env": ["VLLM_ATTENTION_BACKEND"],   # VLLM_* names this vLLM does not read
     "not_read_env": ["SAFETENSORS_FAST_GPU"],   # other names vLLM itself does not read either
     "vllm_version": "0.33.0", "python": "3.12.3", "target_device": "cpu"|null,
     "parser": "vllm serve"|"make_arg_parser", "seconds": total, "import_seconds": float}
Exit code 0 whenever that line was printed (even when the argv is bad); non-zero = the check broke.

Why the exact parser: `vllm serve` builds a top-level "vllm" parser with a "serve" sub-parser made by
make_arg_parser(); an unknown flag is reported by the top-level parser ("vllm: error: unrecognized
arguments: ..."), a bad value by the sub-parser. We build the same tree the same way, so the message
is the one the service would have died with 36 minutes into a load.

Which environment variables vLLM reads: every key of vllm/envs.py's `environment_variables`, plus
every name its source quotes (envs.py reads some inside other entries, e.g. XDG_CACHE_HOME; other
modules read some directly, e.g. VLLM_CUSTOM_ALLREDUCE_ALGO, TORCHINDUCTOR_CACHE_DIR). A requested
name found in neither is reported: a VLLM_* one in `unknown_env` (misspelt or removed, like
VLLM_ATTENTION_BACKEND since 0.26), any other in `not_read_env` (the orchestrator then asks whether
another consumer - NCCL, CUDA, torch, Hugging Face, FlashInfer, Triton - reads it).

Deprecations in vLLM 0.33 come three ways, all reported: argparse `deprecated=True` (Python 3.13+
natively, vLLM's FlexibleArgumentParser._deprecated below 3.13), warnings/log lines emitted while
parsing (e.g. --log-config-file, `--model` with serve), and options whose help text says they are
deprecated (e.g. --disable-cascade-attn, --mamba-cache-mode: vLLM warns only when building the engine).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import re
import sys
import time
import warnings
from typing import Any

_DEPRECATION = re.compile(r"\bdeprecat|will be removed", re.IGNORECASE)


def _target_device(env):
    """VLLM_TARGET_DEVICE=cpu when this machine has no GPU device, so the parser builds anyway.

    vLLM infers its platform from the GPUs it finds ("Failed to infer device type" without one).
    The parser itself is the same on every platform, so CPU is a faithful stand-in there.
    """
    if env.get("VLLM_TARGET_DEVICE") or os.environ.get("VLLM_TARGET_DEVICE"):
        return None
    gpu_nodes = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
    if any(os.path.exists(p) for p in gpu_nodes) or os.path.isdir("/proc/driver/nvidia/gpus"):
        return None
    return "cpu"


def _strip_prefix(argv):
    """The tokens after `serve` (vllm's parser sees exactly these)."""
    argv = list(argv)
    if len(argv) >= 2 and argv[1] == "serve" and not argv[0].startswith("-"):
        argv = argv[1:]          # the vllm executable (any path) then `serve`
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    return argv


def _bad_args(message, argv):
    """The argv tokens an argparse error message is about."""
    m = re.match(r"unrecognized arguments: (.*)", message, re.DOTALL)
    if m:
        listed = m.group(1).split("\n")[0].split(" ")
        return [t for t in listed if t]
    m = re.match(r"argument ([^:]+): (.*)", message, re.DOTALL)
    if m:
        names = [n for n in m.group(1).split("/") if n]
        value = re.search(r"value: '(.*?)'|choice: '(.*?)'", m.group(2))
        out = names + ([value.group(1) or value.group(2)] if value else [])
        return out
    m = re.match(r"the following arguments are required: (.*)", message)
    if m:
        return [n.strip() for n in m.group(1).split(",")]
    return [t for t in argv if t.startswith("-") and t.split("=")[0] in message]


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        try:
            self.messages.append(record.getMessage())
        except Exception:  # a broken log call must not break the check
            pass


def _build_parser():
    """The parser `vllm serve` uses: vLLM's CLI main() tree if importable, else make_arg_parser."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    try:
        import vllm.entrypoints.cli.serve as serve_mod
        top = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")  # prog: as `vllm` runs
        subparsers = top.add_subparsers(required=False, dest="subparser")
        serve = serve_mod.ServeSubcommand().subparser_init(subparsers)
        return top, serve, "vllm serve", serve_mod.ServeSubcommand().validate
    except ImportError:  # a module of the server (not of the parser) missing: parser-only install
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        return parser, parser, "make_arg_parser", validate_parsed_serve_args


def _iter_actions(parser):
    seen = set()
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if id(action) in seen:
                continue
            seen.add(id(action))
            yield p, action
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())


def _deprecated_used(parser, tokens, notes):
    """[{"arg", "message"}] for each deprecated option present in tokens."""
    used = {}
    for t in tokens:
        if t.startswith("-"):
            key = t.split("=", 1)[0]
            key = re.sub(r"(?<=--)[^.]*", lambda m: m.group(0).replace("_", "-"), key, count=1)
            used[key.split(".")[0]] = t
    found = []
    for p, action in _iter_actions(parser):
        hits = [o for o in action.option_strings if o in used]
        if not hits:
            continue
        flagged = getattr(action, "deprecated", False) or action in getattr(p, "_deprecated", ())
        help_text = action.help if isinstance(action.help, str) else ""
        if flagged or _DEPRECATION.search(help_text or ""):
            message = next((n for n in notes if hits[0] in n or action.dest in n), None)
            found.append({"arg": hits[0],
                          "message": message or " ".join((help_text or
                                                          f"argument '{action.dest}' is deprecated").split())})
    for n in notes:  # parse-time deprecation lines not tied to an option above (e.g. `--model`)
        if not any(n == f["message"] for f in found) and not any(f["arg"] in n for f in found):
            arg = next((u for u in used if u in n), None)
            found.append({"arg": arg, "message": " ".join(n.split())})
    return found


_PARSER: dict[str, Any] = {}    # built once per process: importing vLLM is the slow part (~5 s)
_QUOTED: dict[str, bool] = {}   # env name -> does vLLM's source quote it (a scan per name, once per process)


def _quoted_in_vllm(names):
    """The names some .py file of the installed vLLM package quotes ("NAME" or 'NAME')."""
    todo = [n for n in names if n not in _QUOTED]
    if todo:
        import vllm
        found = set()
        root = os.path.dirname(vllm.__file__)
        for folder, _dirs, files in os.walk(root):
            for f in files:
                if not f.endswith(".py"):
                    continue
                try:
                    with open(os.path.join(folder, f), encoding="utf-8", errors="ignore") as fh:
                        text = fh.read()
                except OSError:
                    continue
                for n in todo:
                    if n not in found and ('"%s"' % n in text or "'%s'" % n in text):
                        found.add(n)
            if len(found) == len(todo):
                break
        for n in todo:
            _QUOTED[n] = n in found
    return {n for n in names if _QUOTED.get(n)}


def _env_not_read(env):
    """(VLLM_* names this vLLM does not read, other names vLLM does not read)."""
    import vllm.envs as envs
    known = set(getattr(envs, "environment_variables", {}))
    if not known:           # a vLLM without the table: nothing to say
        return [], []
    rest = [k for k in env if k not in known]
    quoted = _quoted_in_vllm(rest)
    missing = sorted(k for k in rest if k not in quoted)
    return [k for k in missing if k.startswith("VLLM_")], [k for k in missing if not k.startswith("VLLM_")]


def _parser(env, out):
    """Build (once) the serve parser; fills out's version/device/parser/import_seconds fields."""
    if not _PARSER:
        os.environ.update(env)
        device = _target_device(env)
        if device:
            os.environ["VLLM_TARGET_DEVICE"] = device
        _PARSER["device"] = device
        try:
            from importlib.metadata import version
            _PARSER["version"] = version("vllm")
        except Exception:
            _PARSER["version"] = None
        t0 = time.monotonic()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _PARSER["built"] = _build_parser()
        except Exception as exc:  # noqa: BLE001 - report any import failure as data
            _PARSER["error"] = f"{type(exc).__name__}: {exc}"
        _PARSER["import_seconds"] = round(time.monotonic() - t0, 3)
    out.update(vllm_version=_PARSER["version"], target_device=_PARSER["device"],
               import_seconds=_PARSER["import_seconds"])
    if "error" in _PARSER:
        out.update(stage="import", error=_PARSER["error"])
        return None
    out["parser"] = _PARSER["built"][2]
    return _PARSER["built"]


def check(request):
    """One request {"argv", "env"} -> the result object described at the top of this file."""
    started = time.monotonic()
    env = {str(k): str(v) for k, v in (request.get("env") or {}).items()}
    out: dict[str, Any] = {"ok": False, "stage": None, "error": None, "bad_args": [], "deprecated": [],
                           "unknown_env": [], "not_read_env": [], "vllm_version": None,
                           "python": "%d.%d.%d" % sys.version_info[:3], "target_device": None, "parser": None,
                           "seconds": None, "import_seconds": None}
    argv = request.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        out.update(stage="request", error="request.argv must be a list of strings")
        return out
    tokens = _strip_prefix(argv)
    built = _parser(env, out)
    if built is None:
        out["seconds"] = round(time.monotonic() - started, 3)
        return out
    top, serve, kind, validate = built
    saved_environ = dict(os.environ)   # a batch's requests must not see each other's env
    os.environ.update(env)
    try:
        out["unknown_env"], out["not_read_env"] = _env_not_read(env)
    except Exception:  # noqa: BLE001 - the env report is an extra; the parse verdict still counts
        pass

    recorder = _Recorder()
    logging.getLogger("vllm").addHandler(recorder)
    errors = []
    original_error = argparse.ArgumentParser.error

    def recording_error(self, message):
        errors.append((self.prog, message))
        return original_error(self, message)

    # Hook every parser's error() (vLLM's subparsers included) to learn which parser failed and why.
    argparse.ArgumentParser.error = recording_error  # type: ignore[method-assign]  # a deliberate monkeypatch
    parse_argv = (["serve"] + tokens) if kind == "vllm serve" else tokens
    stderr = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(stderr):
            warnings.simplefilter("always")
            try:
                args = top.parse_args(parse_argv)
                out["stage"] = "validate"
                validate(args)
                out["stage"] = None
                out["ok"] = True
            except SystemExit:
                out["stage"] = "parse"
                text = stderr.getvalue()
                if errors:
                    prog, out["error"] = errors[-1]
                    out["error_line"] = f"{prog}: error: {out['error']}"
                else:  # argparse exited without error(): take its last "error:" line
                    m = re.findall(r"error: (.*)", text)
                    out["error"] = m[-1] if m else text.strip()[-500:]
                out["bad_args"] = _bad_args(out["error"], tokens)
            except Exception as exc:  # noqa: BLE001 - validate_parsed_serve_args raises these
                out["stage"] = out["stage"] or "parse"
                out["error"] = re.sub(r"^Error: ", "", str(exc))
                out["bad_args"] = _bad_args(out["error"], tokens)
        notes = [str(w.message) for w in caught] + recorder.messages
        notes += [line for line in stderr.getvalue().splitlines() if "warning:" in line]
        notes = [n for n in notes if _DEPRECATION.search(n)]
        out["deprecated"] = _deprecated_used(top, tokens, notes)
    finally:
        argparse.ArgumentParser.error = original_error  # type: ignore[method-assign]  # undo the hook above
        logging.getLogger("vllm").removeHandler(recorder)
        os.environ.clear()
        os.environ.update(saved_environ)
    out["seconds"] = round(time.monotonic() - started, 3)
    return out


def handle(request):
    """A single request, or {"batch": [request, ...]} -> {"results": [...], "seconds": total}:
    the parser is built once for the whole batch (tests check many argvs in one process)."""
    if "batch" in request:
        started = time.monotonic()
        results = [check(r if isinstance(r, dict) else {}) for r in request["batch"]]
        return {"results": results, "seconds": round(time.monotonic() - started, 3)}
    return check(request)


def main():
    # vLLM logs to stdout by default: keep the real stdout for our one JSON line only.
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        request = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
        if not isinstance(request, dict):
            raise ValueError("the request must be a JSON object")
    except ValueError as exc:
        result = {"ok": False, "stage": "request", "error": f"bad request: {exc}", "bad_args": [],
                  "deprecated": []}
    else:
        result = handle(request)
    real_stdout.write(json.dumps(result) + "\n")
    real_stdout.close()
    sys.stderr.flush()
    # Skip interpreter teardown: with vLLM and torch loaded it takes ~2 s and does nothing useful.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
