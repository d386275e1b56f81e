"""The synthetic repo catalog the SIMULATED Hub mirror serves (pure: no I/O but reading manifests).

Repos carry the ids, file names and shard counts of the real ones, with content scaled down by
`scale` (default 10000: Kimi-K2.5 INT4's ~547 GB becomes ~55 MB). Sizes, sha256 and git oids always
describe the bytes actually served. `model.safetensors.index.json` keeps the *unscaled* total in
`metadata.total_size` (as real index files do), so the simulated vLLM can derive a realistic load
time from the folder it is given; `config.json` carries `"_name_or_path": "<repo id>"`.

Shard layouts (real names):
- moonshotai/Kimi-K2.5: 64 x `model-000NN-of-000064.safetensors` (Moonshot's 5/6-digit naming, as in
  Kimi-K2-Thinking's 62 shards), ~547 GB, index tracked by LFS as in the real repo.
- nvidia/Kimi-K2.5-NVFP4: the real shard count was not found in any public source reachable here;
  we use 119 x `model-000NN-of-00119.safetensors` (the count of a public ModelOpt NVFP4 export of the
  same architecture, ~590 GB) scaled to the ~540 GB of the field report, plus `hf_quant_config.json`.
- MiniMaxAI/MiniMax-M2.5: 126 x `model-00000-of-00126.safetensors` ... `model-00125-of-00126` (0-based,
  as in the real repo's file list), ~230 GB, FP8 block quantisation.
- vllm-orch-sim/tiny-llama-a and -b: REAL loadable models (sim/tinymodel.py: random weights, a
  word-level tokenizer, a chat template; ~1.4 MB), served byte for byte at any scale, for the tests
  and rehearsals that run vLLM's CPU build.
Revisions: each repo has one deterministic commit (`commit_for`) that `main` points to; pinned
revisions (a manifest's `source.revision`) can be registered and then resolve too, to the same
content. Anything else is RevisionNotFound.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.sim import repo_texts as T
from orchestrator.sim import tinymodel
from orchestrator.sim.repo_files import RepoFile, safetensors_header

DEFAULT_SCALE = 10000
# File names a compromised Hub (or an HF_ENDPOINT mirror) could list: each would write outside the
# model folder, or over vllm-orch's own records, if the download trusted it.
HOSTILE_REPO = "vllm-orch-sim/hostile-names"
HOSTILE_NAMES = ("../../escaped-by-dotdot.py", "sub/../../escaped-from-sub.py", "/tmp/vllm-orch-sim-absolute.json",
                 "back\\slash.txt", "./dot.json", "double//slash.json", ".vllm-orch/verified.json",
                 ".cache/huggingface/download/planted.json")
MIN_LFS_BYTES = 4096      # a scaled LFS file never gets smaller than this (room for a header)
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def commit_for(repo_id: str, revision: str = "main") -> str:
    """The deterministic 40-hex commit sha a repo's `main` (or a named revision) resolves to."""
    return hashlib.sha1(f"vllm-orch-sim:{repo_id}:{revision}".encode()).hexdigest()


def scaled(real: int, scale: int) -> int:
    return max(min(real, MIN_LFS_BYTES), real // max(1, scale))


def shard_sizes(repo_id: str, count: int, total: int) -> list[int]:
    """Deterministic real shard sizes around total/count (+-10%, a smaller last shard) summing to total."""
    weights = []
    for i in range(count):
        frac = int.from_bytes(hashlib.sha256(f"{repo_id}/shard/{i}".encode()).digest()[:4], "big") / 2**32
        weights.append(0.9 + 0.2 * frac)
    if count > 1:
        weights[-1] = 0.35
    norm = sum(weights)
    sizes = [int(total * w / norm) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


@dataclass(frozen=True)
class RepoSpec:
    """What a synthetic repo looks like before scaling."""

    repo_id: str
    shard_names: tuple[str, ...]
    total_real_bytes: int
    small_files: dict[str, str]                   # path -> text (git files)
    lfs_text_paths: frozenset[str] = frozenset()                    # text files tracked by LFS
    lfs_binary_files: dict[str, int] = field(default_factory=dict)  # path -> real size (png, tiktoken)
    gated: bool = False
    config: dict = field(default_factory=dict)
    # A repo of real, loadable files (the tiny models a real vLLM serves): path -> bytes, made on
    # first use and served as they are, never scaled. The fields above are then unused.
    exact_files: Callable[[], dict[str, bytes]] | None = None


def _tiny_spec(spec: tinymodel.TinySpec) -> RepoSpec:
    return RepoSpec(repo_id=spec.repo_id, shard_names=(), total_real_bytes=0, small_files={},
                    config=tinymodel.config_json(spec, len(tinymodel.train_vocab(spec.sentences))),
                    exact_files=lambda: tinymodel.model_files(spec))


class Repo:
    """A scaled repo: its files in path order, commit and gating."""

    def __init__(self, spec: RepoSpec, scale: int):
        self.spec = spec
        self.repo_id = spec.repo_id
        self.gated = spec.gated
        self.scale = scale
        self.commit = commit_for(spec.repo_id)
        seed = f"{spec.repo_id}@{scale}"
        if spec.exact_files is not None:
            self.files: dict[str, RepoFile] = {
                path: RepoFile.from_text(path, data, seed=seed, lfs=path.endswith(".safetensors"))
                for path, data in sorted(spec.exact_files().items())}
            return
        files: list[RepoFile] = []
        sizes = shard_sizes(spec.repo_id, len(spec.shard_names), spec.total_real_bytes)
        weight_map = {}
        for i, (name, real) in enumerate(zip(spec.shard_names, sizes)):
            size = scaled(real, scale)
            tensor = f"model.layers.{i}.synthetic.weight"
            weight_map[tensor] = name
            files.append(RepoFile(path=name, size=size, lfs=True, seed=seed, real_size=real,
                                  prefix=safetensors_header(size, tensor)))
        index = {"metadata": {"total_size": spec.total_real_bytes, "sim_scale": scale},
                 "weight_map": weight_map}
        texts = dict(spec.small_files)
        texts["model.safetensors.index.json"] = json.dumps(index, indent=2) + "\n"
        texts["config.json"] = json.dumps(
            {"_name_or_path": spec.repo_id, **spec.config}, indent=2) + "\n"
        for path, text in texts.items():
            files.append(RepoFile.from_text(path, text, seed=seed, lfs=path in spec.lfs_text_paths))
        for path, real in spec.lfs_binary_files.items():
            files.append(RepoFile(path=path, size=scaled(real, scale), lfs=True, seed=seed, real_size=real,
                                  prefix=b"\x89PNG\r\n\x1a\n" if path.endswith(".png") else b""))
        self.files = {f.path: f for f in sorted(files, key=lambda f: f.path)}

    @property
    def total_bytes(self) -> int:
        """Bytes served for the whole repo."""
        return sum(f.size for f in self.files.values())

    def folders(self) -> list[str]:
        """Every folder path implied by the file paths ("docs", "a/b" ...), sorted."""
        out = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                out.add("/".join(parts[:i]))
        return sorted(out)

    def folder_oid(self, folder: str) -> str:
        return hashlib.sha1(f"tree:{self.repo_id}:{folder}".encode()).hexdigest()


# -- the catalog ---------------------------------------------------------------------------------
def _kimi_shards(count: int, digits_total: int = 6) -> tuple[str, ...]:
    return tuple(f"model-{i:05d}-of-{count:0{digits_total}d}.safetensors" for i in range(1, count + 1))


def specs() -> list[RepoSpec]:
    """Every repo the mirror knows, unscaled."""
    kimi_small = T.kimi_small_files()
    return [
        RepoSpec(
            repo_id="moonshotai/Kimi-K2.5",
            shard_names=_kimi_shards(64),
            total_real_bytes=547_000_000_000,
            small_files=kimi_small,
            lfs_text_paths=frozenset({"model.safetensors.index.json"}),   # LFS in the real repo
            lfs_binary_files={"tiktoken.model": 2_795_286, "figures/kimi-logo.png": 277_844},
            config=T.kimi_config(quant="int4"),
        ),
        RepoSpec(
            repo_id="nvidia/Kimi-K2.5-NVFP4",
            shard_names=tuple(f"model-{i:05d}-of-00119.safetensors" for i in range(1, 120)),
            total_real_bytes=540_000_000_000,
            small_files={**kimi_small, "hf_quant_config.json": T.nvfp4_quant_config(),
                         "README.md": T.readme("nvidia/Kimi-K2.5-NVFP4", "NVFP4 (ModelOpt)")},
            lfs_binary_files={"tiktoken.model": 2_795_286},
            config=T.kimi_config(quant="nvfp4"),
        ),
        RepoSpec(
            repo_id="MiniMaxAI/MiniMax-M2.5",
            shard_names=tuple(f"model-{i:05d}-of-00126.safetensors" for i in range(126)),
            total_real_bytes=230_000_000_000,
            small_files=T.minimax_small_files(),
            lfs_binary_files={f"figures/{n}.png": s for n, s in T.MINIMAX_FIGURES.items()},
            config=T.minimax_config(),
        ),
        RepoSpec(   # the small test repo: 3 shards of ~2 MB each at the default scale
            repo_id="vllm-orch-sim/tiny-random-3shard",
            shard_names=tuple(f"model-{i:05d}-of-00003.safetensors" for i in range(1, 4)),
            total_real_bytes=54_000_000_000,
            small_files=T.tiny_small_files("vllm-orch-sim/tiny-random-3shard"),
            config=T.tiny_config(),
        ),
        RepoSpec(   # gated: files need the configured token (401 without, 403 with another)
            repo_id="vllm-orch-sim/gated-tiny",
            shard_names=("model.safetensors",),
            total_real_bytes=10_000_000_000,
            small_files=T.tiny_small_files("vllm-orch-sim/gated-tiny"),
            gated=True,
            config=T.tiny_config(),
        ),
        # Loadable tiny Llamas with random weights, served by a REAL vLLM (CPU build) in tests
        # and rehearsals; two of them so a swap has somewhere to go.
        *(_tiny_spec(t) for t in tinymodel.MODELS.values()),
        RepoSpec(   # a compromised mirror: its listing names files outside the model folder
            repo_id=HOSTILE_REPO,
            shard_names=("model.safetensors",),
            total_real_bytes=1_000_000_000,
            small_files={**T.tiny_small_files(HOSTILE_REPO), **{name: "planted by a hostile hub\n"
                                                               for name in HOSTILE_NAMES}},
            config=T.tiny_config(),
        ),
    ]


class Catalog:
    """The repos at one scale, and which revisions resolve. Thread-safe for reads."""

    def __init__(self, scale: int = DEFAULT_SCALE, revisions: Iterable[tuple[str, str]] = ()):
        self.scale = scale
        self._specs = {s.repo_id: s for s in specs()}
        self._repos: dict[str, Repo] = {}
        self._extra: dict[str, dict[str, str]] = {}     # repo -> revision -> commit
        for repo_id, rev in revisions:
            self.register_revision(repo_id, rev)

    def repo_ids(self) -> list[str]:
        return sorted(self._specs)

    def repo(self, repo_id: str) -> Repo | None:
        """The scaled repo, built on first use (files' sha256 are computed lazily)."""
        if repo_id not in self._specs:
            return None
        if repo_id not in self._repos:
            self._repos[repo_id] = Repo(self._specs[repo_id], self.scale)
        return self._repos[repo_id]

    def register_revision(self, repo_id: str, revision: str) -> None:
        """Make `revision` resolve for `repo_id`: a 40-hex sha resolves to itself, a name to a
        deterministic commit. Unknown repos are ignored (the mirror answers RepoNotFound)."""
        if repo_id not in self._specs or not revision or revision == "main":
            return
        commit = revision if COMMIT_RE.match(revision) else commit_for(repo_id, revision)
        self._extra.setdefault(repo_id, {})[revision] = commit

    def resolve(self, repo_id: str, revision: str) -> str | None:
        """The commit a revision names, or None (RevisionNotFound)."""
        repo = self.repo(repo_id)
        if repo is None:
            return None
        if revision in ("main", repo.commit):
            return repo.commit
        extra = self._extra.get(repo_id, {})
        if revision in extra:
            return extra[revision]
        if revision in extra.values():
            return revision
        return None

    def revisions(self, repo_id: str) -> dict[str, str]:
        repo = self.repo(repo_id)
        return {"main": repo.commit, **self._extra.get(repo_id, {})} if repo else {}


def _manifest_sources(models_dir: str | Path) -> list[tuple[str, dict]]:
    """(name, `source` mapping) of each readable models/*.yaml, read once per call with libyaml's
    loader when PyYAML has it: the mirror starts once per simulated host, and the pure-Python
    loader was most of its start (plain yaml, so the mirror does not depend on the manifest schema)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out = []
    for path in sorted(Path(models_dir).glob("*.y*ml")):
        try:
            data = yaml.load(path.read_text(), Loader=loader) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and isinstance(data.get("source"), dict):
            out.append((str(data.get("name") or path.stem), data["source"]))
    return out


def revisions_from_manifests(models_dir: str | Path) -> list[tuple[str, str]]:
    """(repo, revision) pairs from models/*.yaml `source.repo` + `source.revision`. Unreadable files
    are skipped."""
    return [(str(src["repo"]), str(src.get("revision") or "main"))
            for _, src in _manifest_sources(models_dir) if src.get("repo")]


def model_repos_from_manifests(models_dir: str | Path) -> dict[str, str]:
    """Manifest name -> repo id (for `hub-*` faults that name a model)."""
    return {name: str(src.get("repo")) for name, src in _manifest_sources(models_dir)}
