"""`vllm serve` flags as vLLM's own parser reads them, so extra_args are checked by what vLLM will
do rather than by how they are spelled.

vLLM's FlexibleArgumentParser (vllm/utils/argparse_utils.py, parse_args) turns `_` into `-` in a
`--name` (up to the first `.`, before `=`), and it is an argparse.ArgumentParser with the default
allow_abbrev=True: `--api_key`, `--api-k=x` and `--tensor_parallel_size 2` are `--api-key` and
`--tensor-parallel-size` to it. vllm_serve_flags.txt lists vLLM 0.33.0's options (one a line, all
their spellings, the one named after the option first: `--tensor-parallel-size -tp`), written by
orchestrator/devtools/vllm_flags.py from the real parser and checked against it in
tests/integration/test_vllm_flags_contract.py.
"""

from __future__ import annotations

from functools import lru_cache

from orchestrator.paths import package_file


@lru_cache(maxsize=1)
def spellings() -> dict[str, str]:
    """Every spelling of every `vllm serve` option -> the option's own name (its first spelling)."""
    out: dict[str, str] = {}
    for line in package_file("config", "vllm_serve_flags.txt").read_text().splitlines():
        names = line.split()
        if names and not line.startswith("#"):
            out.update({name: names[0] for name in names})
    return out


def normalise(token: str) -> str:
    """The option name of an argv token as FlexibleArgumentParser sees it: the part before `=`,
    with `_` as `-` in a `--name` and a dotted suffix (`--compilation-config.level`, which sets a
    key of that option) dropped."""
    name = token.split("=", 1)[0]
    if name.startswith("--") and len(name) > 2:
        name = "--" + name[2:].split(".", 1)[0].replace("_", "-")
    return name


def resolve(token: str) -> tuple[str | None, str | None]:
    """(the vLLM option a token sets, or None when it is no option vLLM 0.33 knows; why it must be
    written otherwise, or None). An abbreviation is refused: argparse reads a unique prefix as the
    option it starts (a newer vLLM may add a second option with that prefix, and the checks on
    extra_args compare whole names)."""
    if not token.startswith("-") or token in ("-", "--"):
        return None, None
    name = normalise(token)
    if name == "--model":                       # vLLM's parse_args moves it to the positional model first
        return name, None
    known = spellings()
    if name in known:
        return known[name], None
    if name.startswith("-O"):                    # vLLM's -O3 / -O=3: --optimization-level
        return None, None
    starts = sorted({known[s] for s in known if s.startswith(name) and s.startswith("--") == name.startswith("--")})
    if len(starts) == 1:
        return starts[0], (f"vLLM reads {name} as {starts[0]} (argparse accepts a unique prefix): write the "
                           f"option in full")
    if starts:
        return None, (f"{name} abbreviates several vLLM options ({', '.join(starts[:4])}"
                      f"{', ...' if len(starts) > 4 else ''}): write the option in full")
    return None, None
