"""The settings of the FlexAttention kernels inductor generated: block sizes, warps, stages and the template's
compile-time flags (`IS_DIVISIBLE`, `HAS_FULL_BLOCKS`, `PRESCALE_QK`, ...), read from the Triton code in inductor's
cache directories.

Compiled prefix-reuse chunks ran their FlexAttention calls 1.4-1.8x slower inside the compiled layer graphs than
FlexAttention compiled on its own, on the same calls
(`benchmarks/results/prefix_reuse_gpu_h100_qwen3-1.7b_compiled_profiled.json`).
Run the bench with a fresh `TORCHINDUCTOR_CACHE_DIR` per layout, then compare what each generated:

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_eager python benchmarks/bench_prefix_reuse_gpu.py ... --methods reuse
    TORCHINDUCTOR_CACHE_DIR=/tmp/ind_compiled python benchmarks/bench_prefix_reuse_gpu.py ... --compile
    python benchmarks/flex_kernel_configs.py eager=/tmp/ind_eager compiled=/tmp/ind_compiled --out configs.json

Each distinct kernel is one entry: its name, `num_warps`, `num_stages`, every `NAME : tl.constexpr = value` line of
its body (values as written there), the arguments inductor could not prove multiples of 16 (`not_divisible_by_16`:
pointers whose offset it cannot prove 16-byte aligned, and integer sizes and strides; Triton vectorizes loads and
address arithmetic on the ones it can, and a dynamic-shape graph proves fewer), how many files hold it and one of
them (`example`, under the cache). The output holds each label's kernels under `runs`, beside the run's provenance.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import provenance  # noqa: E402

_HEURISTICS = re.compile(r"@triton_heuristics\.template\((?P<args>.*?)\)\s*@triton\.jit", re.S)
_DEF = re.compile(r"\s*def (?P<name>triton_\w*flex_attention\w*)\(")
_CONSTEXPR = re.compile(r"^\s+(?P<name>[A-Z_][A-Z0-9_]*)\s*:\s*tl\.constexpr\s*=\s*(?P<value>.+?)\s*$", re.M)
_INT_ARG = re.compile(r"\b(num_warps|num_stages)\s*=\s*(\d+)")


def _literal_after(text: str, key: str):
    """The Python literal after `'key': ` in `text` (a dict or list, brackets balanced), or None."""
    start = text.find(f"'{key}': ")
    if start == -1:
        return None
    start += len(key) + 4
    closing = {"{": "}", "[": "]"}.get(text[start : start + 1])
    if closing is None:
        return None
    depth = 0
    for end in range(start, len(text)):
        depth += (text[end] == text[start]) - (text[end] == closing)
        if depth == 0:
            return ast.literal_eval(text[start : end + 1])
    return None


def not_divisible_by_16(args: str) -> list[str] | None:
    """The kernel arguments without Triton's `tt.divisibility` 16 hint in a template decorator's `triton_meta`
    (`signature`: name -> type in argument order; `configs`: `{(index,): [["tt.divisibility", 16], ...]}`), or None
    where the decorator has neither."""
    signature, configs = _literal_after(args, "signature"), _literal_after(args, "configs")
    if signature is None or configs is None:
        return None
    attrs = configs[0] if configs else {}
    hinted = {index for (index,), kinds in attrs.items() if ["tt.divisibility", 16] in kinds}
    return [name for index, name in enumerate(signature) if index not in hinted]


def kernels_in(text: str) -> list[dict]:
    """The FlexAttention template kernels of one generated file: `[{name, num_warps, num_stages, constexprs}]`."""
    found = []
    for match in _HEURISTICS.finditer(text):
        header = _DEF.match(text, match.end())
        if header is None:
            continue
        body_start = header.end()
        following = text.find("\n@triton_heuristics.", body_start)
        body = text[body_start : following if following != -1 else len(text)]
        launch = {}
        for key, value in _INT_ARG.findall(match["args"]):  # the template's own (first) values
            launch.setdefault(key, int(value))
        found.append({
            "name": header["name"], **launch,
            "constexprs": {m["name"]: m["value"] for m in _CONSTEXPR.finditer(body)},
            "not_divisible_by_16": not_divisible_by_16(match["args"]),
        })  # fmt: skip
    return found


def scan(cache_dir: Path) -> list[dict]:
    """Every FlexAttention kernel under `cache_dir` (inductor's cache: generated `.py` files), once per distinct
    name and settings, with the files it appeared in counted."""
    seen: dict[str, dict] = {}
    for path in sorted(cache_dir.rglob("*.py")):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        if "flex_attention" not in text:
            continue
        for kernel in kernels_in(text):
            key = json.dumps(kernel, sort_keys=True)
            entry = seen.setdefault(key, {**kernel, "files": 0, "example": str(path.relative_to(cache_dir))})
            entry["files"] += 1
    return list(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("caches", nargs="+", help="LABEL=DIR: an inductor cache directory and what ran into it")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = {}
    for item in args.caches:
        label, sep, directory = item.partition("=")
        if not sep or not directory:
            sys.exit(f"{item!r} is not LABEL=DIR: name each cache directory, e.g. eager=/tmp/ind_eager")
        if not Path(directory).is_dir():
            sys.exit(f"{directory!r} ({label}) is no directory: give the TORCHINDUCTOR_CACHE_DIR the run used")
        result[label] = scan(Path(directory))
        print(f"{label}: {len(result[label])} FlexAttention kernels", flush=True)
        for kernel in result[label]:
            flags = {k: kernel["constexprs"].get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1",
                                                              "IS_DIVISIBLE", "HAS_FULL_BLOCKS")}  # fmt: skip
            print(f"  {kernel['name']}: warps {kernel.get('num_warps')} stages {kernel.get('num_stages')} {flags}, "
                  f"not divisible by 16: {kernel['not_divisible_by_16']}")  # fmt: skip
    args.out.write_text(json.dumps({**provenance(), "runs": result}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
