"""Render `docs/tree_forest.png`: a small forest as `hf_tree_attn.pack_forest` really packs it.

    python docs/make_tree_figure.py              # writes docs/tree_forest.png
    python docs/make_tree_figure.py --out x.png

Every number in the picture (DFS order, position ids, subtree_end, parents, the mask) is read from the
`PackedForest` that `pack_forest` returns for `SEQUENCES`; nothing is drawn by hand. `tests/test_examples.py`
checks `figure_data()` against an independent trie built token by token, so the picture cannot go stale.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import hf_tree_attn

# matplotlib is imported only by the drawing functions: `figure_data` (and its test) needs nothing but the package.

# A toy vocabulary: id 0 is the padding token pack_forest writes.
VOCAB = ["<pad>", "Q:", "2+3", "=", "5", "4", "!", "<e>", "sys", "hi", "<think>", "hey", "bye", "ciao"]

# Two tries: a GRPO group (3 completions of one prompt; two of them share their first token) and a
# 2-turn agent conversation stored one sample per turn, whose history drops the turn-1 <think> (a branch).
SEQUENCES = [
    ["Q:", "2+3", "=", "5", "<e>"],
    ["Q:", "2+3", "=", "4", "<e>"],
    ["Q:", "2+3", "=", "5", "!", "<e>"],
    ["sys", "hi", "<think>", "hey"],
    ["sys", "hi", "hey", "bye", "<think>", "ciao"],
]
TRIE_LABELS = {"Q:": "GRPO group:\n3 completions\nof one prompt", "sys": "agent, 2 turns,\none sample\nper turn"}
PAD_MULTIPLE = 4  # small so the picture stays readable; real training pads to FlexAttention's block of 128

TRIE_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
PAD_COLOR = "#b0b0b0"
BLOCK_COLOR = "#c44e52"
X_STEP = 1.6  # one depth step, shared by panels 1 and 2 so token j of a sequence sits above depth j


def figure_data(sequences: list[list[str]] = SEQUENCES, pad_multiple: int = PAD_MULTIPLE) -> dict:
    """Everything the figure shows, read from the real `pack_forest` output.

    Returns a dict of numpy arrays over the `S` rows — `tokens` (str), `input_ids`, `position_ids`,
    `subtree_end`, `parent`, `trie` (index of each row's trie, -1 for padding), `mask` `(S, S)` bool — plus
    `positions` (row positions of each sequence, in input order), `num_tree_tokens`, `num_original_tokens` and
    `tree_token_ratio`.
    """
    index = {tok: i for i, tok in enumerate(VOCAB)}
    ids = [[index[tok] for tok in seq] for seq in sequences]
    (forest,) = hf_tree_attn.pack_forest(ids, pad_multiple=pad_multiple)
    parent = forest.parent.numpy()
    trie = np.full(forest.seq_len, -1)
    roots = 0
    for row in range(forest.num_tree_tokens):
        if parent[row] < 0:
            roots += 1
        trie[row] = roots - 1
    positions = [None] * len(sequences)
    for k, seq_id in enumerate(forest.seq_ids):
        positions[seq_id] = forest.positions(k).numpy()
    input_ids = forest.input_ids[0].numpy()
    return {
        "tokens": np.array([VOCAB[i] for i in input_ids]),
        "input_ids": input_ids,
        "position_ids": forest.position_ids[0].numpy(),
        "subtree_end": forest.subtree_end.numpy(),
        "parent": parent,
        "trie": trie,
        "mask": forest.dense_mask()[0, 0].numpy(),
        "positions": positions,
        "num_tree_tokens": forest.num_tree_tokens,
        "num_original_tokens": forest.num_original_tokens,
        "tree_token_ratio": hf_tree_attn.tree_token_ratio(ids),
    }


def _row_color(data: dict, row: int) -> str:
    return PAD_COLOR if data["trie"][row] < 0 else TRIE_COLORS[data["trie"][row] % len(TRIE_COLORS)]


def _token_box(ax, x: float, y: float, text: str, color: str, width: float = 0.9, fontsize: int = 10) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, y - 0.32),
            width,
            0.64,
            boxstyle="round,pad=0.02",
            facecolor=color,
            edgecolor="none",
            alpha=0.9,
        )
    )
    ax.text(x, y, text, ha="center", va="center", color="white", fontsize=fontsize, fontweight="bold")


def _draw_sequences(ax, data: dict, sequences: list[list[str]]) -> None:
    ax.set_title(f"1. Input: {len(sequences)} sequences (under each token: its row in the packed row)", loc="left")
    for i, seq in enumerate(sequences):
        y = -i * 1.25
        ax.text(-0.8, y, f"seq {i}", ha="right", va="center", fontsize=10)
        for j, tok in enumerate(seq):
            row = data["positions"][i][j]
            _token_box(ax, j * X_STEP, y, tok, _row_color(data, row), width=1.15)
            ax.text(j * X_STEP, y - 0.4, f"row {row}", ha="center", va="top", fontsize=7, color="#444444")
    ax.set_xlim(-4.0, (max(map(len, sequences)) - 1) * X_STEP + 1.0)
    ax.set_ylim(-(len(sequences) - 1) * 1.25 - 1.0, 0.6)
    ax.axis("off")


def _draw_forest(ax, data: dict) -> None:
    """Horizontal trees: x = depth (= position id), leaves stacked in DFS order, parents centred on children."""
    n = data["num_tree_tokens"]
    parent, depth = data["parent"][:n], data["position_ids"][:n]
    children = {r: [c for c in range(n) if parent[c] == r] for r in range(n)}
    y = {}
    next_leaf = 0.0
    for r in range(n):  # leaves in DFS order, a gap between tries
        if parent[r] < 0 and r > 0:
            next_leaf += 0.6
        if not children[r]:
            y[r] = next_leaf
            next_leaf += 1.0
    for r in range(n - 1, -1, -1):  # children come after their parent in DFS order
        if children[r]:
            y[r] = float(np.mean([y[c] for c in children[r]]))
    for r in range(n):
        if parent[r] >= 0:
            p = parent[r]
            ax.plot([depth[p] * X_STEP, depth[r] * X_STEP], [-y[p], -y[r]], color="#888888", lw=1.5, zorder=1)
    for r in range(n):
        _token_box(ax, depth[r] * X_STEP, -y[r], data["tokens"][r], _row_color(data, r), width=1.15)
        ax.text(depth[r] * X_STEP, -y[r] - 0.4, f"row {r}", ha="center", va="top", fontsize=7, color="#444444")
        if parent[r] < 0:
            label = TRIE_LABELS.get(data["tokens"][r], "")
            ax.text(-0.8, -y[r], label, ha="right", va="center", fontsize=9, color=_row_color(data, r))
    ax.set_title(
        f"2. The forest: {n} unique tokens instead of {data['num_original_tokens']} "
        f"(tree_token_ratio = {data['tree_token_ratio']:.3f})",
        loc="left",
    )
    for d in range(depth.max() + 1):
        ax.text(d * X_STEP, -next_leaf - 0.1, str(d), ha="center", va="center", fontsize=9)
    ax.text(-0.8, -next_leaf - 0.1, "position id = depth:", ha="right", va="center", fontsize=9, fontweight="bold")
    ax.set_xlim(-4.0, depth.max() * X_STEP + 1.0)
    ax.set_ylim(-next_leaf - 0.5, 0.8)
    ax.axis("off")


def _draw_row_and_mask(ax, data: dict) -> None:
    """The DFS row as a table whose columns line up with the mask's key columns, then the mask itself."""
    from matplotlib.patches import Rectangle

    s = len(data["tokens"])
    mask = data["mask"]
    for q in range(s):
        for kv in range(s):
            if mask[q, kv]:
                color = _row_color(data, kv)
                ax.add_patch(Rectangle((kv, q), 1, 1, facecolor=color, edgecolor="white", lw=1))
            else:
                ax.add_patch(Rectangle((kv, q), 1, 1, facecolor="#f4f4f4", edgecolor="white", lw=1))

    table = [  # (name, cells, height): token names are written vertically, so their line is taller
        ("row", [str(r) for r in range(s)], 1.0),
        ("input_ids (text)", data["tokens"].tolist(), 2.4),
        ("position_ids", [str(v) for v in data["position_ids"]], 1.0),
        ("subtree_end", [str(v) for v in data["subtree_end"]], 1.0),
        ("parent", [str(v) for v in data["parent"]], 1.0),
    ]
    table_top = -sum(height for *_, height in table) - 0.4
    yy = table_top
    for name, cells, height in table:
        is_token = name.startswith("input_ids")
        ax.text(-0.3, yy + height / 2, name, ha="right", va="center", fontsize=9, fontweight="bold")
        for kv, text in enumerate(cells):
            ax.text(
                kv + 0.5,
                yy + height / 2,
                text,
                ha="center",
                va="center",
                fontsize=8,
                rotation=90 if is_token and len(text) > 2 else 0,
                color=_row_color(data, kv) if is_token else "black",
                fontweight="bold" if is_token else "normal",
            )
        yy += height
    for q in range(s):
        ax.text(
            -0.3, q + 0.5, f"{q} {data['tokens'][q]}", ha="right", va="center", fontsize=8, color=_row_color(data, q)
        )

    # Outline where each branch meets its next sibling: the later branch's rows, the earlier branch's columns.
    parent, end = data["parent"], data["subtree_end"]
    boxes = []
    for r in range(data["num_tree_tokens"]):
        kids = [c for c in range(data["num_tree_tokens"]) if parent[c] == r]
        for a, b in zip(kids[:-1], kids[1:]):
            ax.add_patch(
                Rectangle((a, b), end[a] - a, end[b] - b, fill=False, edgecolor=BLOCK_COLOR, lw=2.5, zorder=5)
            )
            boxes.append((a, b))
    a, b = boxes[0]
    ax.annotate(
        f"red: sibling branches are blocked\n(rows {b}..{end[b] - 1} cannot see rows {a}..{end[a] - 1})",
        xy=(end[a], b + 0.5),
        xytext=(end[a] + 3.0, b - 1.6),
        fontsize=9,
        color=BLOCK_COLOR,
        arrowprops={"arrowstyle": "->", "color": BLOCK_COLOR},
    )

    ax.set_xlim(-4.5, s + 0.2)
    ax.set_ylim(s + 1.6, table_top - 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        "3. The DFS row the model sees (one forward)\n4. Its attention mask: row q sees column kv  ⇔  "
        "kv ≤ q < subtree_end[kv]",
        loc="left",
    )
    ax.text(
        0,
        s + 0.9,
        "query rows ↓, key columns →; coloured = attend (ancestor or self), grey = blocked; "
        "padding rows see only themselves.",
        fontsize=9,
        va="center",
    )


def render(path: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = figure_data()
    fig = plt.figure(figsize=(17, 10), dpi=110)
    grid = fig.add_gridspec(
        2,
        2,
        width_ratios=[1, 1.35],
        height_ratios=[1, 1.2],
        wspace=0.05,
        hspace=0.15,
        left=0.01,
        right=0.99,
        top=0.92,
        bottom=0.02,
    )
    _draw_sequences(fig.add_subplot(grid[0, 0]), data, SEQUENCES)
    _draw_forest(fig.add_subplot(grid[1, 0]), data)
    _draw_row_and_mask(fig.add_subplot(grid[:, 1]), data)
    fig.suptitle("Tree training: shared prefixes computed once", fontsize=15, fontweight="bold", x=0.01, ha="left")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("tree_forest.png"))
    args = parser.parse_args()
    render(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
