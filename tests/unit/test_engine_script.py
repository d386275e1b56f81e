"""The host-side engine script (orchestrator/host/remote/engine.py) on folders made here: what counts
as a built venv, and what its removal refuses to touch."""

from __future__ import annotations

import importlib.util
import json
import os

from orchestrator.config.engine import lock_of
from orchestrator.config.manifest import Engine
from orchestrator.paths import package_file

spec = importlib.util.spec_from_file_location("engine_script", package_file("host", "remote", "engine.py"))
script = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
spec.loader.exec_module(script)  # type: ignore[union-attr]

LOCK = lock_of(Engine(vllm="0.33.0", torch="2.13.0+cu130"))


def args(root) -> dict:
    return {"root": str(root), "lock": LOCK.as_dict()}


def test_the_script_hashes_a_lock_as_the_controller_does():
    assert script.lock_hash(LOCK.as_dict()) == LOCK.hash


def test_missing_partial_mismatch_and_a_link_are_told_apart(tmp_path):
    root = tmp_path / "engines"
    root.mkdir()
    assert script.check(args(root))["state"] == "missing"
    venv = root / LOCK.name
    venv.mkdir()
    assert script.check(args(root))["state"] == "partial"          # no marker: a build cut short
    other = lock_of(Engine(vllm="0.24.0"))
    (venv / script.MARKER).write_text(json.dumps({"hash": other.hash, "lock": {
        "python": other.python, "requirements": list(other.requirements)}}))
    assert script.check(args(root))["state"] == "mismatch"
    (venv / script.MARKER).write_text(json.dumps({"hash": LOCK.hash, "lock": {
        "python": LOCK.python, "requirements": list(LOCK.requirements)}}))
    broken = script.check(args(root))                                 # its marker is right, it does not run
    assert broken["state"] == "broken" and "does not run" in broken["detail"]
    forged = dict(LOCK.as_dict(), hash="0" * 16)
    assert script.check({"root": str(root), "lock": forged})["state"] == "mismatch"
    os.rename(venv, tmp_path / "elsewhere")
    venv.symlink_to(tmp_path / "elsewhere")
    assert script.check(args(root))["state"] == "broken"            # a link is no venv vllm-orch built


def test_remove_and_list_touch_only_engine_venv_folders_under_the_root(tmp_path):
    root = tmp_path / "engines"
    root.mkdir()
    keep = tmp_path / "precious"
    keep.mkdir()
    (root / LOCK.name).symlink_to(keep)
    (root / "not-an-engine").mkdir()
    (root / f"vllm-0.24.0-{'a' * 16}").mkdir()
    assert script.remove({"root": str(root), "name": LOCK.name})["removed"] is False
    assert script.remove({"root": str(root), "name": "not-an-engine"})["removed"] is False
    assert script.remove({"root": str(root), "name": f"../{keep.name}"})["removed"] is False
    assert keep.is_dir() and (root / "not-an-engine").is_dir()
    listed = script.listing({"root": str(root)})["engines"]
    assert [e["name"] for e in listed] == [f"vllm-0.24.0-{'a' * 16}"] and listed[0]["complete"] is False
    assert script.remove({"root": str(root), "name": f"vllm-0.24.0-{'a' * 16}"})["removed"] is True


def built_venv(root, runs: list) -> str:
    """A venv folder as a build leaves it (marker, pyvenv.cfg, bin/, site-packages with the pinned
    distributions' dist-info folders), with the script's verify replaced by one that counts its runs
    (the real verify imports vLLM: tests/integration/test_engines_sim.py runs it)."""
    venv = root / LOCK.name
    sp = venv / "lib" / "python3.11" / "site-packages"
    for d in ("vllm", "vllm-0.33.0.dist-info", "torch-2.13.0+cu130.dist-info", "requests-2.32.0.dist-info"):
        (sp / d).mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").symlink_to(os.sys.executable)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / script.MARKER).write_text(json.dumps({"hash": LOCK.hash, "lock": {
        "python": LOCK.python, "requirements": list(LOCK.requirements)}}))
    return str(venv)


def counting(monkeypatch, fails: str | None = None) -> list:
    runs: list = []

    def verify(venv, lock, user=None):
        runs.append(venv)
        return (fails, None) if fails else (None, "0.33.0")

    monkeypatch.setattr(script, "verify", verify)
    return runs


def test_a_passed_verify_is_recorded_and_trusted_while_the_venv_is_unchanged(tmp_path, monkeypatch):
    root = tmp_path / "engines"
    runs = counting(monkeypatch)
    venv = built_venv(root, runs)
    first = script.check(args(root))
    assert first["state"] == "ok" and first["verified"] == "now" and first["recorded"] is True
    assert first["why_verified"] == "no verdict recorded" and len(runs) == 1
    verdict = os.stat(os.path.join(venv, script.VERDICT))
    assert verdict.st_uid == os.geteuid() and verdict.st_mode & 0o777 == 0o644
    recorded = json.loads(open(os.path.join(venv, script.VERDICT)).read())
    assert recorded["hash"] == LOCK.hash and recorded["vllm_version"] == "0.33.0"
    assert recorded["python"] == os.path.realpath(os.sys.executable)
    assert set(recorded["fingerprint"]["dist-info"]) == {"vllm-0.33.0.dist-info", "torch-2.13.0+cu130.dist-info"}
    second = script.check(args(root))
    assert second["state"] == "ok" and second["verified"] == "earlier" and len(runs) == 1     # nothing ran
    assert second["vllm_version"] == "0.33.0" and second["verified_at"] == recorded["verified_at"]
    forced = script.check(dict(args(root), force=True))
    assert forced["verified"] == "now" and forced["why_verified"] == "--verify-engine" and len(runs) == 2


def test_a_changed_venv_re_verifies(tmp_path, monkeypatch):
    root = tmp_path / "engines"
    runs = counting(monkeypatch)
    venv = built_venv(root, runs)
    sp = os.path.join(venv, "lib", "python3.11", "site-packages")

    def changed_by(change) -> dict:
        assert script.check(args(root))["verified"] in ("now", "earlier")      # a verdict for the state now
        before = len(runs)
        change()
        answer = script.check(args(root))
        assert answer["verified"] == "now" and len(runs) == before + 1, answer
        assert answer["why_verified"] == "the venv changed since it was verified"
        assert script.check(args(root))["verified"] == "earlier" and len(runs) == before + 1
        return answer

    # vLLM reinstalled: its dist-info folder gets new contents (pip writes RECORD, INSTALLER...)
    changed_by(lambda: open(os.path.join(sp, "vllm-0.33.0.dist-info", "RECORD"), "w").close())
    # a pinned package upgraded in place: its dist-info folder replaced by another version's
    changed_by(lambda: os.rename(os.path.join(sp, "torch-2.13.0+cu130.dist-info"),
                                 os.path.join(sp, "torch-2.14.0.dist-info")))
    # any package added to or removed from site-packages, pinned or not
    changed_by(lambda: os.rmdir(os.path.join(sp, "requests-2.32.0.dist-info")))
    # the Python the venv runs is another file now
    other = tmp_path / "python3"
    other.write_bytes(b"")

    def relink() -> None:
        os.remove(os.path.join(venv, "bin", "python"))
        os.symlink(other, os.path.join(venv, "bin", "python"))
    changed_by(relink)
    # the venv rebuilt: its marker written again (same content, another file)

    def remark() -> None:
        marker = os.path.join(venv, script.MARKER)
        with open(marker + ".tmp", "w") as f:
            f.write(open(marker).read())
        os.replace(marker + ".tmp", marker)
    changed_by(remark)


def test_a_garbled_foreign_or_writable_verdict_re_verifies_and_is_replaced(tmp_path, monkeypatch):
    root = tmp_path / "engines"
    runs = counting(monkeypatch)
    venv = built_venv(root, runs)
    path = os.path.join(venv, script.VERDICT)
    script.check(args(root))
    good = open(path).read()
    cases = {
        "does not parse": lambda: open(path, "w").write(good[: len(good) // 2]),
        "not this lock's": lambda: open(path, "w").write(json.dumps(dict(json.loads(good), hash="0" * 16))),
        "not one vllm-orch wrote": lambda: os.chmod(path, 0o666),
        "no verdict": lambda: (os.remove(path), os.symlink(tmp_path / "elsewhere.json", path)),
    }
    (tmp_path / "elsewhere.json").write_text(good)
    for why, garble in cases.items():
        before = len(runs)
        garble()
        answer = script.check(args(root))
        assert answer["state"] == "ok" and answer["verified"] == "now" and len(runs) == before + 1, (why, answer)
        assert why in answer["why_verified"], (why, answer)
        assert not os.path.islink(path) and os.stat(path).st_mode & 0o777 == 0o644
        assert json.loads(open(path).read())["hash"] == LOCK.hash         # the full check wrote a good one back
        assert script.check(args(root))["verified"] == "earlier"


def test_a_verify_that_fails_removes_the_verdict(tmp_path, monkeypatch):
    root = tmp_path / "engines"
    counting(monkeypatch)
    venv = built_venv(root, [])
    assert script.check(args(root))["recorded"] is True
    counting(monkeypatch, fails="import vllm failed: ImportError: libcudart.so.13")
    answer = script.check(dict(args(root), force=True))
    assert answer["state"] == "broken" and "libcudart" in answer["detail"]
    assert not os.path.exists(os.path.join(venv, script.VERDICT))
    runs = counting(monkeypatch)
    assert script.check(args(root))["verified"] == "now" and len(runs) == 1


REQUEST = {"argv": ["serve", "org/m", "--max-num-seqs", "8"], "env": {"VLLM_X": "1"}, "script": "a" * 64}
PASSED = {"ok": True, "stage": None, "error": None, "vllm_version": "0.33.0", "deprecated": []}


def remember(root, request=REQUEST, answer=PASSED) -> dict:
    return script.remember(dict(args(root), argcheck=request, answer=answer))


def kept(root, request=REQUEST, **more):
    return script.check(dict(args(root), argcheck=request, **more)).get("argcheck")


def test_a_parser_answer_is_kept_only_for_its_exact_request_and_only_when_it_passed(tmp_path, monkeypatch):
    root = tmp_path / "engines"
    counting(monkeypatch)
    venv = built_venv(root, [])
    assert remember(root)["recorded"] is False                       # no verdict yet: the venv never verified
    assert kept(root) is None                                        # (this full check records one)
    assert remember(root)["recorded"] is True
    st = os.stat(os.path.join(venv, script.ARGCHECK))
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o644
    assert kept(root) == PASSED
    for other in ({**REQUEST, "argv": [*REQUEST["argv"], "-tp", "2"]}, {**REQUEST, "env": {}},
                  {**REQUEST, "script": "b" * 64}, None, "garbage"):
        assert kept(root, other) is None, other                     # another argv, env or argcheck.py
    assert kept(root, force=True) is None                           # --verify-engine asks the parser too
    assert kept(root) == PASSED
    refused = dict(PASSED, ok=False, stage="parse", error="unrecognized arguments: --swap-space 4")
    assert remember(root, answer=refused) == {"recorded": False, "why": "only an answer that passed is kept"}
    for i in range(script.ARGCHECK_KEEP + 2):                       # bounded: the newest are kept
        assert remember(root, {**REQUEST, "argv": ["serve", "m", str(i)]})["recorded"] is True
    answers = json.loads(open(os.path.join(venv, script.ARGCHECK)).read())["answers"]
    assert len(answers) == script.ARGCHECK_KEEP and kept(root) is None
    assert kept(root, {**REQUEST, "argv": ["serve", "m", str(script.ARGCHECK_KEEP + 1)]}) == PASSED


def test_a_garbled_foreign_or_stale_kept_answer_is_not_found_never_an_error(tmp_path, monkeypatch):
    root = tmp_path / "engines"
    runs = counting(monkeypatch)
    venv = built_venv(root, runs)
    path = os.path.join(venv, script.ARGCHECK)
    script.check(args(root))
    assert remember(root)["recorded"] is True
    good = open(path).read()
    garbles = [lambda: open(path, "w").write(good[: len(good) // 2]),
               lambda: open(path, "w").write('{"answers": []}'),
               lambda: open(path, "w").write(json.dumps({"answers": {k: {"answer": "x", "at": 1} for k in
                                                                     json.loads(good)["answers"]}})),
               lambda: os.chmod(path, 0o666),
               lambda: (os.remove(path), os.symlink(tmp_path / "elsewhere.json", path))]
    (tmp_path / "elsewhere.json").write_text(good)
    for garble in garbles:
        garble()
        answer = script.check(dict(args(root), argcheck=REQUEST))
        assert answer["state"] == "ok" and answer["verified"] == "earlier" and answer["argcheck"] is None, answer
        assert remember(root)["recorded"] is True and kept(root) == PASSED      # written over, good again
    # the venv changed (vLLM reinstalled): its fingerprint is in the key, so the old answer is not found
    sp = os.path.join(venv, "lib", "python3.11", "site-packages")
    open(os.path.join(sp, "vllm-0.33.0.dist-info", "RECORD"), "w").close()
    answer = script.check(dict(args(root), argcheck=REQUEST))
    assert answer["verified"] == "now" and answer["argcheck"] is None
    # a verify that fails forgets the kept answers with the verdict
    assert remember(root)["recorded"] is True
    counting(monkeypatch, fails="import vllm failed")
    script.check(dict(args(root), force=True))
    assert not os.path.exists(path)


def test_an_answer_over_linux_argv_word_limit_is_kept_through_the_host_and_its_args_file_removed(tmp_path,
                                                                                                  monkeypatch):
    """Linux caps one argv word at 128 KiB (MAX_ARG_STRLEN, include/uapi/linux/binfmts.h): an answer
    of 200 KB sent as the script's argument was refused by exec (E2BIG), so `remember` silently kept
    nothing. Through the real host interface and the real script (a subprocess): a small answer
    goes as before, a large one through a 0600 file under engines_root that the script reads and
    deletes."""
    import sys

    from orchestrator.config.inventory import HostEntry
    from orchestrator.host.engine import remember_argcheck
    from orchestrator.host.local import LocalHost

    root = tmp_path / "engines"
    counting(monkeypatch)
    built_venv(root, [])
    assert kept(root) is None                                         # this full check records the verdict
    entry = HostEntry(name="h", address="local", engines_root=str(root), python=sys.executable)
    host = LocalHost("h")
    assert remember_argcheck(host, entry, LOCK, REQUEST, PASSED) is True
    assert kept(root) == PASSED
    big_request = {**REQUEST, "argv": ["serve", "org/m", "--big"]}
    big = {**PASSED, "deprecated": ["x" * 1000] * 200}                 # ~200 KB of JSON
    assert len(json.dumps(big)) > 128 * 1024
    assert remember_argcheck(host, entry, LOCK, big_request, big) is True
    assert kept(root, big_request) == big
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []     # the args file is gone


def test_the_args_file_is_read_only_when_it_is_a_regular_file_of_ours_and_named_like_one(tmp_path):
    """main()'s `--args-file`: a link, a FIFO or another name is refused and left where it is."""
    import subprocess
    import sys

    src = package_file("host", "remote", "engine.py").read_bytes()
    good = tmp_path / (".args-" + "a" * 32 + ".json")
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"root": str(tmp_path)}))
    good.symlink_to(target)
    fifo = tmp_path / (".args-" + "b" * 32 + ".json")
    os.mkfifo(fifo)
    other = tmp_path / "args.json"
    other.write_text(json.dumps({"root": str(tmp_path)}))
    for path in (good, fifo, other):
        r = subprocess.run([sys.executable, "-", "list", "--args-file", str(path)], input=src, capture_output=True,
                           timeout=60)
        assert r.returncode != 0 and b"args" in r.stderr, (path, r.stderr)
        assert os.path.lexists(path)
    assert target.exists() and other.exists()
    os.chmod(other, 0o600)
    os.rename(other, tmp_path / (".args-" + "c" * 32 + ".json"))
    r = subprocess.run([sys.executable, "-", "list", "--args-file", str(tmp_path / (".args-" + "c" * 32 + ".json"))],
                       input=src, capture_output=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["engines"] == [], r.stderr
    assert not (tmp_path / (".args-" + "c" * 32 + ".json")).exists()
