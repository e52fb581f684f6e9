"""`pack_forest` vs a per-token Python dict trie on a GRPO-sized batch, side by side on the CPU.

Workload (seeded): 32 groups x 16 completions; each prompt has 1024 random token ids, each completion 128-640
(uniform) random ids from a 150k vocabulary — about 720k tokens in 512 sequences.

Both builders produce the same output: the DFS-preorder row (token, depth, parent, subtree_end, padded to 128)
and every sequence's row positions. The dict-trie builder is the obvious per-token implementation (insert every
token into nested dicts, then walk the trie with children heaviest subtree first, ties by token, as `pack_forest`
orders them), so the comparison is fair; its output is checked equal to `pack_forest`'s, array by array.

    python benchmarks/bench_pack.py --out benchmarks/results/pack_forest_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from harness import provenance

from hf_tree_attn import pack_forest


def make_batch(groups: int, completions: int, prompt: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(groups):
        p = rng.integers(0, vocab, prompt)
        for _ in range(completions):
            sequences.append(np.concatenate([p, rng.integers(0, vocab, int(rng.integers(lo, hi + 1)))]).tolist())
    return sequences


def dict_trie_pack(sequences: list[list[int]], pad_multiple: int = 128) -> dict[str, np.ndarray | list]:
    """The per-token baseline: nested-dict trie, then an explicit DFS for the layout (children by decreasing
    subtree size, ties by token)."""
    children: list[dict[int, int]] = [{}]  # node 0 = empty root
    token = [-1]
    paths = []
    for seq in sequences:
        node, path = 0, []
        for tok in seq:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(token)
                children[node][tok] = nxt
                children.append({})
                token.append(tok)
            node = nxt
            path.append(node)
        paths.append(path)

    n = len(token) - 1
    nodes = [1] * (n + 1)  # trie nodes in each node's subtree; a child is always created after its parent
    for node in range(n, 0, -1):
        for child in children[node].values():
            nodes[node] += nodes[child]

    def heavy_first(node: int) -> list[int]:  # children in visiting order
        return [c for _, c in sorted(children[node].items(), key=lambda item: (-nodes[item[1]], item[0]))]

    padded = -(-n // pad_multiple) * pad_multiple
    row_of = [0] * (n + 1)
    tokens, depth, parent = [0] * padded, [0] * padded, [-1] * padded
    stack = [(child, -1, 0) for child in reversed(heavy_first(0))]
    row = 0
    while stack:
        node, parent_row, d = stack.pop()
        row_of[node] = row
        tokens[row], depth[row], parent[row] = token[node], d, parent_row
        stack.extend((child, row, d + 1) for child in reversed(heavy_first(node)))
        row += 1
    size = [1] * padded
    for r in range(n - 1, -1, -1):  # preorder: a subtree is the rows right after its root
        if parent[r] >= 0:
            size[parent[r]] += size[r]
    subtree_end = [r + size[r] for r in range(padded)]
    positions = [[row_of[node] for node in path] for path in paths]
    return {
        "input_ids": np.array(tokens),
        "position_ids": np.array(depth),
        "parent": np.array(parent),
        "subtree_end": np.array(subtree_end),
        "positions": positions,
        "num_tree_tokens": n,
    }


def timed(fn, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "repeats": repeats, "all_s": times}


def check_equal(sequences, reference: dict, forest) -> None:
    """The dict trie's layout must be exactly `pack_forest`'s (same DFS order)."""
    assert reference["num_tree_tokens"] == forest.num_tree_tokens, (
        reference["num_tree_tokens"],
        forest.num_tree_tokens,
    )
    for name in ("input_ids", "position_ids"):
        assert np.array_equal(reference[name], getattr(forest, name)[0].numpy()), name
    for name in ("parent", "subtree_end"):
        assert np.array_equal(reference[name], getattr(forest, name).numpy()), name
    assert forest.seq_ids == list(range(len(sequences)))
    for k, rows in enumerate(reference["positions"]):
        assert rows == forest.positions(k).tolist(), f"positions of sequence {k}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--completion-min", type=int, default=128)
    parser.add_argument("--completion-max", type=int, default=640)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--baseline-repeats", type=int, default=5)
    parser.add_argument("--max-tokens-per-mb", type=int, default=16384, help="budget of the micro-batched row")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    sequences = make_batch(
        args.groups, args.completions, args.prompt, args.completion_min, args.completion_max, args.vocab, args.seed
    )
    as_tensors = [torch.tensor(s) for s in sequences]
    total = sum(len(s) for s in sequences)

    (forest,) = pack_forest(sequences)
    check_equal(sequences, dict_trie_pack(sequences), forest)

    rows = {
        "dict_trie (per-token Python), list[list[int]]": timed(
            lambda: dict_trie_pack(sequences), args.baseline_repeats
        ),
        "pack_forest, list[list[int]]": timed(lambda: pack_forest(sequences), args.repeats),
        "pack_forest, list[LongTensor]": timed(lambda: pack_forest(as_tensors), args.repeats),
        f"pack_forest, list[list[int]], max_tokens_per_mb={args.max_tokens_per_mb}": timed(
            lambda: pack_forest(sequences, max_tokens_per_mb=args.max_tokens_per_mb), args.repeats
        ),
    }
    baseline = rows["dict_trie (per-token Python), list[list[int]]"]["median_s"]
    speedup = baseline / rows["pack_forest, list[list[int]]"]["median_s"]
    budgeted = pack_forest(sequences, max_tokens_per_mb=args.max_tokens_per_mb)

    width = max(len(k) for k in rows)
    print(f"{total} tokens in {len(sequences)} sequences, {forest.num_tree_tokens} unique (ratio "
          f"{forest.num_tree_tokens / total:.3f}); dict trie layout == pack_forest layout: yes")  # fmt: skip
    print(f"| {'builder, input':<{width}} | median s | min s  | repeats | speedup vs dict trie |")
    print(f"|{'-' * (width + 2)}|----------|--------|---------|----------------------|")
    for name, r in rows.items():
        print(f"| {name:<{width}} | {r['median_s']:8.4f} | {r['min_s']:.4f} | {r['repeats']:7d} | "
              f"{baseline / r['median_s']:19.1f}x |")  # fmt: skip
    print(f"speedup (list input, median): {speedup:.1f}x (target >= 5x); "
          f"{len(budgeted)} micro-batches at max_tokens_per_mb={args.max_tokens_per_mb}")  # fmt: skip

    if args.out is not None:
        result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "python": platform.python_version(),
            },
            **provenance(numpy=np.__version__),
            "workload": {
                "groups": args.groups,
                "completions_per_group": args.completions,
                "prompt_tokens": args.prompt,
                "completion_tokens": [args.completion_min, args.completion_max],
                "vocab": args.vocab,
                "seed": args.seed,
                "sequences": len(sequences),
                "total_tokens": total,
                "unique_tokens": forest.num_tree_tokens,
                "micro_batches_at_budget": len(budgeted),
            },
            "layout_equal_to_dict_trie": True,
            "timings": rows,
            "speedup_median": speedup,
            "target_speedup": 5.0,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
