"""Tree vs flat on one GPU: the GRPO trainer phase, side by side on the same batch.

Trainer phase = old-logprob forward (no grad) + policy forward + backward, gradient checkpointing on, logits
only for scored (completion) tokens, bf16, random weights from configs shaped like Qwen3, Gemma-3-1B (sliding-window
layers) or Qwen3.5 (no download). Qwen3.5 (hybrid: 3 Gated DeltaNet layers per full-attention layer) runs its
recurrent layers segment by segment (level by level, or in two calls on deep trees: `--delta-rule-two-pass-from`;
flash-linear-attention's varlen kernel where installed); its
packed flat baseline is a forest without sharing (one root segment per sequence: one varlen call, a document mask).

Methods, all on the same model object (`attn_implementation="tree_flex"`):
  flat_padded  rows right-padded to the micro-batch's longest row, SDPA with a padding mask (what TRL does);
  flat_packed  padding-free: sequences concatenated in one row, FlexAttention document mask (each layer kind's
               own: a sliding-window layer's document mask keeps its window);
  tree         hf_tree_attn: prefix forest, FlexAttention tree mask (or, for a GRPO-shaped forest where
               `hf_tree_attn.prefix_attention.fast_on_cuda` picks them, the shared-prefix kernels), LM head on
               unique parent rows;
  tree_flex    (`--compare-flex`) the tree with FlexAttention in every layer.
Every method processes the whole logical batch in micro-batches of at most `--max-tokens-per-mb` tokens
(flat_padded: rows x padded length), and scores exactly the same tokens with the same chunked LM head.

    python benchmarks/bench_tree_vs_flat.py --models qwen3-0.6b --out benchmarks/results/tree_vs_flat.json
    python benchmarks/bench_tree_vs_flat.py --models gemma3-1b --workloads grpo_G16_P4096_C512 ...

Each method runs a warm-up step and `--repeats` timed steps (at least 8: `harness.MIN_MEASURED_STEPS`), each
repeat's seconds kept (`times_s`; `time_s` their median). Per run, `paired["tree vs flat_padded"]` and
`paired["tree vs flat_packed"]` (and each other tree method's `"<method> vs flat_padded"`): `harness.paired`, the
baseline's repeat k over the tree's repeat k on the same batch, min / median / max; `speedup_vs_padded` /
`speedup_vs_packed` stay the ratio of the two medians. Agreement (`agreement[method]`): an untimed step of each
method (the gradient probe) keeps every sequence's scored log-probabilities from its policy forward — the same tokens
in every method, in the workload's order — and the largest |difference| to flat_padded's must be within
`harness.LOGPROB_BOUND[dtype]`, its gradient cosine to flat_padded's at least `GRAD_COS_BOUND[dtype]`. A pair whose
methods disagree, or with fewer repeats than the minimum (`error`, no ratio), is `failed` with its `reason`, the run
`failed`, and the printed summary says so. `--perturb-tree EPS` scores the tree methods with noise of relative size
EPS on the weights: their agreement must then fail (the check's own check).

    python benchmarks/bench_tree_vs_flat.py --models tiny --workloads smoke --device cpu \
        --out /tmp/tree_vs_flat_cpu.json                        # CPU smoke run, float32

Kernels and recompute apply to every method alike: `--liger` (Liger's RMSNorm / SwiGLU / RoPE, as TRL's
`use_liger_kernel=True`), `--compile-layers` (regional torch.compile of the decoder layers, as accelerate's
`dynamo_use_regional_compilation`), `--checkpointing all|none|auto` (auto: the tree recomputes only the layers
`TreeGRPOConfig.tree_recompute="auto"` would, bounded by flat_padded's largest micro-batch with every layer
checkpointed; flat keeps every layer). Each method's `mfu` = its model FLOPs
(`estimate_flops`: the tree's unique tokens for the tree, the unpadded sequences for flat; x4 for the old-logprob
forward, the policy forward and the backward; recompute not counted) / time / `PEAK_FLOPS`.

    python benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads agent_20_turns --repeats 1

For hybrids each tree run is also timed with every segment made a root ("tree_one_level": the same tokens and
kernels in one call per layer, wrong states — timing only): `level_overhead` = the share of the tree's time that
going level by level costs. Only with a varlen Gated DeltaNet kernel (flash-linear-attention): without one, one
call pads every segment to the longest, which is no level cost (benchmarks/bench_levels.py measures it kernel by
kernel).

`--gdn-route` picks the Gated DeltaNet kernels of every method alike (`benchmarks/gdn_kernels.py`: torch,
flash_qla, fla_tilelang, fla_triton; default: whatever transformers resolved). Each method's `gdn_kernels` records the
kernels its timed steps really called (counted at the kernels' entry points), and `gdn_route_problem` any call that
was not the route's.

    python benchmarks/bench_tree_vs_flat.py --models qwen3.5-0.8b --workloads grpo_G16_P4096_C512 --scale 0.5 \
        --gdn-route flash_qla --out benchmarks/results/tree_vs_flat_h200_qwen3.5-0.8b_flash_qla.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import gdn_kernels
import torch
from harness import LOGPROB_BOUND, MIN_MEASURED_STEPS, agreement, paired, provenance
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3_5TextConfig, Qwen3Config

import hf_tree_attn
from hf_tree_attn import recurrent
from hf_tree_attn.logprobs import _final_hidden_states, forest_logprobs, lm_head_logprobs
from hf_tree_attn.masks import TreeMaskSource
from hf_tree_attn.recompute import (
    _checkpointed_layers,
    checkpoint_count,
    keeps_attention,
    recompute_only,
    unpriced_reason,
)
from hf_tree_attn.recurrent import _use_varlen, tree_layer_types
from hf_tree_attn.transformers_compat import install as install_transformers_wrappers
from hf_tree_attn.tree import PackedForest

# H200 SXM dense bf16 tensor-core peak (NVIDIA's datasheet gives 1,979 TFLOPS with 2:4 sparsity; dense is half).
PEAK_FLOPS = 989e12

MODELS = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    # google/gemma-3-1b-pt's shape: 5 sliding-window layers (window 512) per full layer.
    "gemma3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, vocab_size=262144, query_pre_attn_scalar=256,
                      sliding_window=512, max_position_embeddings=32768, tie_word_embeddings=True,
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]),
    # Qwen3.5-shaped (approximate sizes of the 0.8B / 2B models): 24 layers, a full-attention layer (gated, head 256)
    # after every 3 Gated DeltaNet layers (16 key / 16 value heads of 128, 4-tap conv), vocab 248k.
    "qwen3.5-0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, vocab_size=248320, tie_word_embeddings=True,
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4,
                         layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6),
    "qwen3.5-2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=256, vocab_size=248320, tie_word_embeddings=True,
                       linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6),
    # CPU smoke runs (`--models tiny --workloads smoke --device cpu`): Qwen3's layer, two layers, a small vocab.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=2048, tie_word_embeddings=True),
}  # fmt: skip
CONFIG_CLASSES = {"gemma3-1b": Gemma3TextConfig, "qwen3.5-0.8b": Qwen3_5TextConfig, "qwen3.5-2b": Qwen3_5TextConfig}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class MaskTimer:
    """Time spent building layer masks (inside the forwards: each layer kind's mask is built on first use)."""

    total = 0.0
    _build = TreeMaskSource.mask

    @classmethod
    def install(cls):
        def timed(source, *args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            mask = cls._build(source, *args, **kwargs)
            _sync()
            cls.total += time.perf_counter() - t0
            return mask

        TreeMaskSource.mask = timed

    @classmethod
    def take(cls) -> float:
        spent, cls.total = cls.total, 0.0
        return spent


@dataclass
class Workload:
    name: str
    sequences: list[list[int]]
    prompt_lengths: list[int]  # tokens before this depth are context, not scored
    spec: dict

    def __post_init__(self):
        # Per-token loss weights (think advantage x mask), tied to (sequence, position) so all methods compute
        # the same loss: sum_i sum_t w[i][t] * logp_i(t).
        gen = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(len(s) - p, generator=gen) for s, p in zip(self.sequences, self.prompt_lengths)]


def grpo_workload(rng: random.Random, groups: int, g: int, p: int, c: int, vocab: int, vary: bool = False) -> Workload:
    """`groups` prompts of `p` tokens, `g` completions each of `c` tokens (`c/2..c` tokens with `vary`)."""
    seqs, prompt_lengths = [], []
    for _ in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(p)]
        for _ in range(g):
            length = rng.randint(c // 2, c) if vary else c
            seqs.append(prompt + [rng.randrange(vocab) for _ in range(length)])
            prompt_lengths.append(p)
    spec = {"kind": "grpo", "groups": groups, "G": g, "prompt": p, "completion": f"U[{c // 2},{c}]" if vary else c}
    return Workload(f"grpo_G{g}_P{p}_C{c}", seqs, prompt_lengths, spec)


def agent_workload(
    rng: random.Random, conversations: int, vocab: int, system: int = 4800, turns: tuple[int, int] = (10, 20)
) -> Workload:
    """tau2-like: a shared system prompt, `turns` turns (uniform); each turn is one sample per sampled response (2
    branches) holding the whole history; the conversation continues from the first branch (a branch point per turn:
    one recurrent level per turn). Only the response is scored."""
    sys_prompt = [rng.randrange(vocab) for _ in range(system)]
    seqs, prompt_lengths = [], []
    for _ in range(conversations):
        history = list(sys_prompt)
        for _ in range(rng.randint(*turns)):
            history += [rng.randrange(vocab) for _ in range(rng.randint(40, 200))]  # user / tool message
            responses = [[rng.randrange(vocab) for _ in range(rng.randint(80, 400))] for _ in range(2)]
            for r in responses:
                seqs.append(history + r)
                prompt_lengths.append(len(history))
            history += responses[0]
    spec = {"kind": "agent", "conversations": conversations, "system": system, "turns": f"U[{turns[0]},{turns[1]}]",
            "user": "U[40,200]", "response": "U[80,400]", "branches": 2}  # fmt: skip
    name = "tau2_like_agent" if turns == (10, 20) else f"agent_{turns[0]}_turns"
    return Workload(name, seqs, prompt_lengths, spec)


def unshared_workload(rng: random.Random, n: int, vocab: int) -> Workload:
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1024, 3072))] for _ in range(n)]
    return Workload("no_sharing", seqs, [len(s) // 2 for s in seqs], {"kind": "none", "n": n, "length": "U[1k,3k]"})


def _token_budget_batches(lengths: list[int], budget: int, padded: bool) -> list[list[int]]:
    """Consecutive (length-sorted) micro-batches of sequence indices within `budget` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        cost = (len(cur) + 1) * lengths[cur[0] if cur else i] if padded else sum(lengths[j] for j in cur) + lengths[i]
        if cur and cost > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur]


def _keep_scores(scores: dict | None, indices: list[int], wl: Workload, logps: torch.Tensor) -> None:
    """Into `scores` (when given): each sequence's scored log-probabilities, `logps` being those of `indices` one
    after the other (their tokens from the prompt on), detached, float32, on the host."""
    if scores is None:
        return
    counts = [len(wl.sequences[i]) - wl.prompt_lengths[i] for i in indices]
    for i, values in zip(indices, logps.detach().float().cpu().split(counts)):
        scores[i] = values


def flat_padded_step(model, wl: Workload, budget: int, device, scores: dict | None = None) -> dict:
    """`scores` (a dict): filled with each sequence's scored log-probabilities of the policy forward (index ->
    tensor), as every step function does; the agreement check compares them across methods."""
    lengths = [len(s) for s in wl.sequences]
    for train in (False, True):
        for batch in _token_budget_batches(lengths, budget, padded=True):
            width = max(lengths[i] for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            sources, targets, weights = [], [], []
            for b, i in enumerate(batch):
                ids[b, : lengths[i]] = torch.tensor(wl.sequences[i])
                mask[b, : lengths[i]] = 1
                t = torch.arange(wl.prompt_lengths[i], lengths[i])
                sources.append(b * width + t - 1)
                targets.append(ids[b, t])
                weights.append(wl.weights[i])
            ids, mask = ids.to(device), mask.to(device)
            sources, targets = torch.cat(sources).to(device), torch.cat(targets).to(device)
            weights = torch.cat(weights).to(device)
            with torch.set_grad_enabled(train):
                inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
                hidden = _final_hidden_states(model, inputs)[0].flatten(0, 1)
                logps, _ = lm_head_logprobs(model, hidden, sources, targets)
                if train:
                    _keep_scores(scores, batch, wl, logps)
                    (logps * weights).sum().backward()
    return {}


def flat_packed_step(model, wl: Workload, budget: int, device, scores: dict | None = None) -> dict:
    lengths = [len(s) for s in wl.sequences]
    batches = _token_budget_batches(lengths, budget, padded=False)
    prepared = []
    MaskTimer.take()
    for batch in batches:
        total = sum(lengths[i] for i in batch)
        seq_len = -(-total // 128) * 128
        ids = torch.zeros(seq_len, dtype=torch.long)
        pos = torch.zeros(seq_len, dtype=torch.long)
        end = torch.arange(1, seq_len + 1, dtype=torch.int32)
        sources, targets, weights, off = [], [], [], 0
        for i in batch:
            n = lengths[i]
            ids[off : off + n] = torch.tensor(wl.sequences[i])
            pos[off : off + n] = torch.arange(n)
            end[off : off + n] = off + n
            t = torch.arange(wl.prompt_lengths[i], n)
            sources.append(off + t - 1)
            targets.append(ids[off + t])
            weights.append(wl.weights[i])
            off += n
        # Documents back to back are a forest without sharing: the same per-layer-kind masks serve as document masks.
        dense = torch.device(device).type != "cuda"
        source = TreeMaskSource(end.to(device), pos.to(device), torch.tensor([lengths[i] for i in batch]), {}, dense)
        prepared.append(
            (
                batch,
                ids[None].to(device),
                pos[None].to(device),
                source.carrier,
                *(torch.cat(x).to(device) for x in (sources, targets, weights)),
            )
        )
    for train in (False, True):
        for batch, ids, pos, mask, sources, targets, weights in prepared:
            with torch.set_grad_enabled(train):
                inputs = {"input_ids": ids, "position_ids": pos, "attention_mask": mask, "use_cache": False}
                if FLEX_KERNEL_OPTIONS is not None:
                    inputs["kernel_options"] = dict(FLEX_KERNEL_OPTIONS)
                hidden = _final_hidden_states(model, inputs)[0][0]
                logps, _ = lm_head_logprobs(model, hidden, sources, targets)
                if train:
                    _keep_scores(scores, batch, wl, logps)
                    (logps * weights).sum().backward()
    return {"mask_s": MaskTimer.take()}


def _packed_forest(sequences: list[list[int]]) -> PackedForest:
    """The sequences concatenated in one row without sharing (a document mask); the forest derives its segments:
    one root segment per sequence."""
    lengths = torch.tensor([len(s) for s in sequences])
    total = int(lengths.sum())
    size = -(-total // 128) * 128
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    rows = torch.arange(total)
    doc = torch.repeat_interleave(torch.arange(len(sequences)), lengths)
    depth = rows - starts[doc]
    parent = torch.where(depth > 0, rows - 1, -1)
    ids, pos = torch.zeros(1, size, dtype=torch.long), torch.zeros(1, size, dtype=torch.long)
    ids[0, :total] = torch.tensor([t for s in sequences for t in s])
    pos[0, :total] = depth
    end = torch.arange(1, size + 1)
    end[:total] = starts[1:][doc]
    return PackedForest(
        input_ids=ids,
        position_ids=pos,
        subtree_end=end.to(torch.int32),
        parent=torch.cat([parent, torch.full((size - total,), -1)]),
        seq_ids=list(range(len(sequences))),
        num_tree_tokens=total,
        num_original_tokens=total,
        seq_positions=rows,
        seq_offsets=starts,
    )  # fmt: skip


def flat_packed_forest_step(model, wl: Workload, budget: int, device, scores: dict | None = None) -> dict:
    """Padding-free packing for hybrids: recurrent layers need the document boundaries (one varlen call), which a
    forest without sharing carries; attention gets the same document mask as `flat_packed_step`."""
    lengths = [len(s) for s in wl.sequences]
    prepared = []
    MaskTimer.take()
    for batch in _token_budget_batches(lengths, budget, padded=False):
        forest = _packed_forest([wl.sequences[i] for i in batch])
        rows = torch.cat([forest.positions(k)[wl.prompt_lengths[i] :] for k, i in enumerate(batch)])
        weights = torch.cat([wl.weights[i] for i in batch])
        prepared.append((batch, forest.to(device), rows.to(device), weights.to(device)))
    for train in (False, True):
        for batch, forest, rows, weights in prepared:
            with torch.set_grad_enabled(train):
                table, _ = forest_logprobs(model, forest, rows=rows)
                if train:
                    _keep_scores(scores, batch, wl, table[rows])
                    (table[rows] * weights).sum().backward()
    return {"mask_s": MaskTimer.take()}


def flat_padded_positions(wl: Workload, budget: int) -> list[int]:
    """Positions each flat_padded micro-batch computes: rows x padded width. Their sum is flat's work; their max
    bounds a tree forward's activations under `recompute="auto"` (the trainer's rule, with TRL's flat forward of the
    same rows as the bound; here flat runs its rows in token-budgeted micro-batches)."""
    lengths = [len(s) for s in wl.sequences]
    return [len(b) * max(lengths[i] for i in b) for b in _token_budget_batches(lengths, budget, padded=True)]


def _one_level(forest: PackedForest) -> PackedForest:
    """The forest with every segment made a root: one recurrent call per layer (wrong states; timing only)."""
    roots = torch.full_like(forest.segment_parent, -1)
    return dataclasses.replace(forest, segment_parent=roots, segment_level=torch.zeros_like(roots), _scan_cache={})


def tree_step(
    model,
    wl: Workload,
    budget: int,
    device,
    fallback_ratio: float | None = None,
    recompute: str = "all",
    one_level: bool = False,
    keep_attention: bool = True,
    budget_gib: float | None = None,
    scores: dict | None = None,
) -> dict:
    """The tree path. With `fallback_ratio` it decides like TreeGRPOTrainer (`tree_max_token_ratio`): when the
    forests hold more than that fraction of the positions the flat padded forward computes, go flat_padded. With
    `recompute="auto"` each forest's policy forward recomputes only the layers `tree_recompute="auto"` would, and
    those keep the shared-prefix kernels' outputs as the trainer's do (unless `keep_attention=False`: they recompute
    whole; `budget_gib`: `tree_activation_budget_gib`). With `one_level`, recurrent layers run all segments in one
    call (see `_one_level`)."""
    t0 = time.perf_counter()
    forests = hf_tree_attn.pack_forest(wl.sequences, max_tokens_per_mb=budget)
    if one_level:
        forests = [_one_level(f) for f in forests]
    pack_time = time.perf_counter() - t0
    tree_tokens = sum(f.num_tree_tokens for f in forests)
    if fallback_ratio is not None and tree_tokens > fallback_ratio * sum(flat_padded_positions(wl, budget)):
        decided = time.perf_counter() - t0
        flat = flat_padded_step(model, wl, budget, device, scores)
        return {**flat, "pack_s": decided, "mask_s": 0.0, "micro_batches": 0}
    prepared = []
    MaskTimer.take()
    for forest in forests:
        rows = torch.cat([forest.positions(k)[wl.prompt_lengths[s] :] for k, s in enumerate(forest.seq_ids)])
        # A row shared by several sequences carries the sum of their weights: the same loss as flat.
        row_weights = torch.zeros(forest.seq_len).index_add_(
            0, rows, torch.cat([wl.weights[s] for s in forest.seq_ids])
        )
        # With `scores`: each sequence's scored rows, in its token order (a shared row is read by every sequence).
        seq_rows = None
        if scores is not None:
            seq_rows = rows.split([len(wl.sequences[s]) - wl.prompt_lengths[s] for s in forest.seq_ids])
        forest = forest.to(device)
        rows = torch.unique(rows)
        prepared.append((forest, rows.to(device), row_weights[rows].to(device), seq_rows))
    config = model.config
    if recompute == "auto" and unpriced_reason(config, _checkpointed_layers(model)[0]) is not None:
        recompute = "all"  # as the trainer: layers the activation model does not price recompute every layer
    keep = recompute == "auto" and keep_attention and keeps_attention(model)
    keep = keep and any(hf_tree_attn.prefix_attention.serves(f, device.type) for f, *_ in prepared)
    flat_forward = max(flat_padded_positions(wl, budget)) if recompute == "auto" else None
    checkpointed = []
    for train in (False, True):  # each layer kind's mask: built in the first forward, reused by the rest
        for forest, rows, weights, seq_rows in prepared:
            count = None
            if train and recompute == "auto":
                bound = min(forest.num_original_tokens, flat_forward)
                count = checkpoint_count(config, forest.seq_len, bound, keep_attention=keep, budget_gib=budget_gib)
                checkpointed.append(count / config.num_hidden_layers)
            with torch.set_grad_enabled(train), recompute_only(model, count, keep_attention=keep):
                table, _ = forest_logprobs(model, forest, rows=rows)
                if train:
                    if scores is not None:
                        _keep_scores(scores, forest.seq_ids, wl, table[torch.cat(seq_rows).to(table.device)])
                    (table[rows] * weights).sum().backward()
    levels = max(f.num_levels for f in forests)
    out = {"pack_s": pack_time, "mask_s": MaskTimer.take(), "micro_batches": len(forests), "levels": levels}
    out["kept_attention"] = keep
    return {**out, "checkpointed_layers": statistics.mean(checkpointed)} if checkpointed else out


def without_prefix_kernels(step):
    """`step` with `hf_tree_attn.prefix_attention` off: FlexAttention's tree mask in every layer (`--compare-flex`)."""

    @functools.wraps(step)
    def run(*args, **kwargs):
        mode, hf_tree_attn.prefix_attention.MODE = hf_tree_attn.prefix_attention.MODE, "never"
        try:
            return step(*args, **kwargs)
        finally:
            hf_tree_attn.prefix_attention.MODE = mode

    return run


METHODS = {"flat_padded": flat_padded_step, "flat_packed": flat_packed_step, "tree": tree_step}
FALLBACK_RATIO = 0.9  # TreeGRPOConfig.tree_max_token_ratio's default


GDN_ROUTE: str | None = None  # `--gdn-route`, checked against the kernels each method calls


def time_method(fn, model, wl, budget, device, repeats: int) -> dict:
    """A warm-up step, then `repeats` timed steps of `fn`: `times_s` each repeat's seconds (in order: the paired
    ratios pair repeat k of two methods), `time_s` their median, `peak_gib` the peak allocated (None off CUDA)."""
    cuda = torch.device(device).type == "cuda"
    fn(model, wl, budget, device)  # warm-up: compiles, allocator
    model.zero_grad(set_to_none=True)
    _sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, extras = [], []
    with gdn_kernels.KernelProbe() as probe:
        for _ in range(repeats):
            _sync()
            t0 = time.perf_counter()
            extras.append(fn(model, wl, budget, device))
            _sync()
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    out = {"time_s": statistics.median(times), "times_s": times, "peak_gib": peak}
    for key in extras[0]:
        out[key] = statistics.median(e[key] for e in extras)
    if probe.calls:  # a model with Gated DeltaNet layers: which kernels the timed steps called
        out["gdn_kernels"] = gdn_kernels.describe(probe.calls)
        out["gdn_calls"] = dict(probe.calls)
        if GDN_ROUTE is not None and (problem := gdn_kernels.route_problem(GDN_ROUTE, probe.calls)) is not None:
            out["gdn_route_problem"] = problem
    return out


def gdn_varlen(model, device: torch.device | None = None) -> bool:
    """Whether the model's Gated DeltaNet layers run varlen kernel calls (one per level, no padding)."""
    install_transformers_wrappers()
    modules = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
    kernels = [sys.modules[name].torch_chunk_gated_delta_rule.tree_original for name in modules]
    return any(_use_varlen(kernel, device or torch.device("cuda")) for kernel in kernels)


def grad_probe(model, fn, wl, budget, device, scores: dict | None = None) -> torch.Tensor:
    """Gradients of a few parameters (first and last layer, embeddings) after one (untimed) step of `fn`, flattened
    fp32; `scores` gets the step's per-sequence scored log-probabilities (the policy forward's)."""
    fn(model, wl, budget, device, scores=scores)
    names = ("embed_tokens", "layers.0.", f"layers.{model.config.num_hidden_layers - 1}.mlp.down_proj")
    params = ((n.replace("._orig_mod", ""), p) for n, p in model.named_parameters())  # compiled layers' names
    grads = [p.grad.float().flatten() for n, p in params if any(k in n for k in names)]
    model.zero_grad(set_to_none=True)
    # Kept off the GPU (it must not count in the next method's peak memory), in float64: a float32 cosine over
    # ~10^8 entries on the CPU is off by ~1e-2.
    return torch.cat(grads).cpu().double()


# The smallest gradient cosine to flat_padded's (the probed parameters) a method may have. bfloat16: the committed
# H200 runs land at 0.9977 (Qwen3-8B) to 0.9999 (Qwen3-0.6B); float32 leaves only the order of summation.
GRAD_COS_BOUND = {"bfloat16": 0.99, "float32": 0.9999}


@contextlib.contextmanager
def perturbed(model, eps: float):
    """`model`'s weights plus `eps` x each weight's RMS of seeded Gaussian noise, restored on exit (`--perturb-tree`:
    the tree is scored with wrong weights, so its agreement must fail)."""
    if not eps:
        yield
        return
    generator, saved = torch.Generator().manual_seed(0), []
    with torch.no_grad():
        for param in model.parameters():
            saved.append(param.detach().clone())
            noise = torch.randn(param.shape, generator=generator).to(param.device)
            param.add_((noise * eps * param.float().pow(2).mean().sqrt()).to(param.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for param, original in zip(model.parameters(), saved):
                param.copy_(original)


def check_run(run: dict, scores: dict[str, list[float]], dtype: str, min_repeats: int = MIN_MEASURED_STEPS) -> None:
    """`run["agreement"]`, `run["paired"]` and `run["failed"]` of one workload's run (`scores`: each probed method's
    scored log-probabilities, every sequence's in the workload's order: the same tokens in every method).

    `agreement[method]`, every method but flat_padded: its log-probabilities against flat_padded's, the largest
    |difference| within `harness.LOGPROB_BOUND[dtype]` (`harness.agreement`), and its `grad_cos_vs_flat_padded` at
    least `GRAD_COS_BOUND[dtype]`. `paired["tree vs flat_padded"]`, `paired["tree vs flat_packed"]` and every other
    probed tree method's `"<method> vs flat_padded"`: `harness.paired` of the repeats' seconds (the baseline's repeat k
    over the tree's repeat k, the same batch), `failed` with the `reason` where either method's agreement failed or
    fewer than `min_repeats` repeats were timed (then `error`, paired's own words, and no ratio)."""
    bound, cos_bound = LOGPROB_BOUND[dtype], GRAD_COS_BOUND[dtype]
    run["agreement"] = {}
    for method, values in scores.items():
        if method == "flat_padded":
            continue
        check = agreement(values, scores.get("flat_padded", []), bound=bound)
        cos = run[method].get("grad_cos_vs_flat_padded")
        check.update(grad_cos=cos, grad_cos_bound=cos_bound)
        reasons = [check.pop("reason")] if "reason" in check else []
        if not reasons and not check["passed"]:
            reasons.append(f"log-probs differ by up to {check['max_abs']:.3g} > {bound:g}")
        if cos is None or not cos >= cos_bound:
            reasons.append(f"gradient cosine {cos if cos is None else f'{cos:.6f}'} < {cos_bound:g}")
        check["passed"] = not reasons
        if reasons:
            check["reason"] = "; ".join(reasons)
        run["agreement"][method] = check
    run["paired"] = {}
    pairs = [("tree", "flat_padded"), ("tree", "flat_packed")]
    pairs += [(m, "flat_padded") for m in scores if m.startswith("tree") and m != "tree"]
    for candidate, baseline in pairs:
        reasons = []
        for method in (candidate, baseline):
            if method == "flat_padded":
                continue
            check = run["agreement"].get(method)
            if check is None:
                reasons.append(f"{method}: no agreement check")
            elif not check["passed"]:
                reasons.append(f"{method}: {check['reason']}")
        try:
            pair = paired(run[baseline]["times_s"], run[candidate]["times_s"], min_repeats)
        except ValueError as error:
            pair = {"error": str(error)}
            reasons.append(str(error))
        pair["failed"] = bool(reasons)
        if reasons:
            pair["reason"] = "; ".join(reasons)
        run["paired"][f"{candidate} vs {baseline}"] = pair
    run["failed"] = any(pair["failed"] for pair in run["paired"].values())


def paired_summary(run: dict) -> str:
    """The printed line under a run's row: its paired ratios and agreement, or why it failed."""
    parts = []
    for key, pair in run["paired"].items():
        if "median" in pair:
            ratio = f"{pair['median']:.2f}x [{pair['min']:.2f}, {pair['max']:.2f}]"
            parts.append(f"{key} {ratio} ({pair['steps']} paired)")
    check = run["agreement"].get("tree", {})
    if "max_abs" in check:
        cos = check["grad_cos"]
        parts.append(f"tree log-probs max |diff| {check['max_abs']:.2g} (bound {check['bound']:g}, "
                     f"{check['tokens']} tokens), grad cos {cos:.6f} (bound {check['grad_cos_bound']:g})")  # fmt: skip
    failures = [f"{key}: {pair['reason']}" for key, pair in run["paired"].items() if pair["failed"]]
    status = "FAILED: " + " | ".join(failures) if failures else "agrees"
    return "  paired: " + "; ".join(parts) + ("; " if parts else "") + status


def build_model(
    name: str,
    device,
    liger: bool = False,
    compile_layers: bool = False,
    checkpointing: str = "all",
    dtype: torch.dtype = torch.bfloat16,
):
    torch.manual_seed(0)
    config = CONFIG_CLASSES.get(name, Qwen3Config)(**MODELS[name], attention_dropout=0.0)
    with device:  # random init on the GPU: an 8B init on the host takes minutes
        model = AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex", dtype=dtype)
    model.train()
    if checkpointing != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if liger:  # what TRL's use_liger_kernel=True applies (its fused linear cross-entropy stays off)
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, {"fused_linear_cross_entropy": False})
    if compile_layers:  # what accelerate's regional compilation does
        from accelerate.utils import compile_regions

        # Every method runs through the same compiled layers: flat_padded's micro-batch shapes, flat_packed's and the
        # tree's masks each add graphs, and past dynamo's default limit (8 per frame) a frame silently runs eagerly
        # for the methods that come later.
        torch._dynamo.config.recompile_limit = 64
        model = compile_regions(model)
    return model


FLEX_KERNEL_OPTIONS: dict | None = None
_FOREST_FORWARD_KWARGS = hf_tree_attn.logprobs.forest_forward_kwargs


def _forest_forward_kwargs_with_options(forest, device) -> dict:
    kwargs = _FOREST_FORWARD_KWARGS(forest, device)
    return kwargs if FLEX_KERNEL_OPTIONS is None else {**kwargs, "kernel_options": dict(FLEX_KERNEL_OPTIONS)}


def set_flex_kernel_options(options: dict | None) -> None:
    """FlexAttention `kernel_options` (block sizes, warps, stages; forward and backward) for every tree and packed
    forward from here on: `tree_flex` passes the model kwarg `kernel_options` to FlexAttention, and the forests'
    forward kwargs (and flat_packed's) carry it. None: FlexAttention's defaults."""
    global FLEX_KERNEL_OPTIONS
    FLEX_KERNEL_OPTIONS = dict(options) if options is not None else None
    hf_tree_attn.logprobs.forest_forward_kwargs = _forest_forward_kwargs_with_options


def model_flops(method: str, timing: dict, flops: dict) -> float:
    """Model FLOPs of one trainer phase (old-logprob forward + policy forward + backward = 4 forwards): the tree's
    unique work, or the unpadded sequences' for flat methods and a tree step that fell back to flat."""
    tree = method.startswith("tree") and timing.get("micro_batches", 0) > 0
    return 4 * (flops["tree_flops"] if tree else flops["flat_flops"])


def recompile_check(model, budget, device, vocab) -> dict:
    """Steps of varying lengths after warm-up: how many new dynamo graphs the tree path compiles."""
    counters = torch._dynamo.utils.counters
    rng = random.Random(7)
    graphs = []
    for _ in range(6):
        wl = grpo_workload(rng, groups=rng.randint(2, 6), g=16, p=rng.randint(500, 2500), c=rng.randint(128, 700),
                           vocab=vocab, vary=True)  # fmt: skip
        tree_step(model, wl, budget, device)
        model.zero_grad(set_to_none=True)
        graphs.append(int(counters["stats"]["unique_graphs"]))
    return {"unique_graphs_after_each_step": graphs, "new_graphs_after_step_2": graphs[-1] - graphs[1]}


def e2e_step(model, device, vocab: int, g: int = 16, p: int = 4096, c: int = 512) -> dict:
    """One GRPO step with generation: `model.generate` of G completions (KV cache, sdpa path) + the tree trainer
    phase on the result. Random weights never emit EOS early, so every completion has `c` tokens."""
    rng = random.Random(1)
    prompt = torch.tensor([[rng.randrange(vocab) for _ in range(p)]], device=device).repeat(g, 1)
    model.eval()
    times = []
    for _ in range(2):  # first call warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, do_sample=True, max_new_tokens=c, min_new_tokens=c, pad_token_id=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    model.train()
    wl = Workload("e2e", out.tolist(), [p] * g, {"G": g, "prompt": p, "completion": c})
    trainer = time_method(tree_step, model, wl, 65536, device, repeats=2)["time_s"]
    gen = times[-1]
    return {"spec": wl.spec, "generate_s": gen, "trainer_phase_s": trainer, "trainer_share": trainer / (gen + trainer)}


def smoke_workload(vocab: int) -> Workload:
    """`--workloads smoke`, for CPU smoke runs: 2 prompts of 256 tokens, 8 completions of 32 each."""
    wl = grpo_workload(random.Random(0), 2, 8, 256, 32, vocab)
    wl.name = "smoke"
    return wl


def build_workloads(s: float, vocab: int) -> list[Workload]:
    """Every workload at scale `s` (seeded: the same sequences on every run)."""
    rng = random.Random(0)
    return [
        grpo_workload(rng, max(1, round(8 * s)), 8, 1024, 1024, vocab),
        grpo_workload(rng, max(1, round(8 * s)), 16, 2048, 256, vocab),
        grpo_workload(rng, max(1, round(4 * s)), 16, 4096, 512, vocab),
        grpo_workload(rng, max(1, round(8 * s)), 32, 1024, 128, vocab),
        agent_workload(rng, max(1, round(2 * s)), vocab),
        unshared_workload(rng, max(2, round(32 * s)), vocab),
        agent_workload(rng, max(1, round(2 * s)), vocab, turns=(20, 20)),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b"], choices=list(MODELS))
    parser.add_argument("--workloads", nargs="+", default=None, help="names to run (default: all)")
    parser.add_argument("--max-tokens-per-mb", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=MIN_MEASURED_STEPS,
                        help=f"timed repeats per method (paired ratios need {MIN_MEASURED_STEPS})")  # fmt: skip
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of groups/conversations")
    parser.add_argument("--recompile-check", action="store_true")
    parser.add_argument("--e2e", action="store_true", help="also time one GRPO step with generation")
    parser.add_argument("--liger", action="store_true", help="Liger layer kernels on every method")
    parser.add_argument("--compile-layers", action="store_true", help="regional compile of the decoder layers")
    parser.add_argument("--checkpointing", choices=["all", "none", "auto"], default="all")
    parser.add_argument(
        "--compare-whole-recompute",
        action="store_true",
        help="with --checkpointing auto, also time the tree with its checkpointed layers recomputed whole (their "
        "attention too): tree_whole_recompute",
    )
    parser.add_argument(
        "--compare-budget-gib",
        type=float,
        nargs="+",
        default=[],
        help="with --checkpointing auto, also time the tree under each of these tree_activation_budget_gib values: "
        "tree_budget_<value>gib",
    )
    parser.add_argument(
        "--compare-flex",
        action="store_true",
        help="also time the tree with FlexAttention in every layer (prefix kernels off): tree_flex",
    )
    parser.add_argument("--flex-kernel-options", type=json.loads, default=None,
                        help='FlexAttention kernel_options as JSON, e.g. {"BLOCK_M": 128, "BLOCK_N": 64}')  # fmt: skip
    parser.add_argument(
        "--gdn-route",
        choices=["installed", *gdn_kernels.ROUTES],
        default="installed",
        help="Gated DeltaNet kernels for every method (benchmarks/gdn_kernels.py); fla_triton lifts fla's Hopper "
        "refusal, which the models' K = 128 tiles allow",
    )
    parser.add_argument(
        "--delta-rule-two-pass-from",
        type=int,
        default=None,
        help="on varlen kernels the tree's delta rule runs in two kernel calls on forests of at least this many "
        "levels, level by level below (hf_tree_attn.recurrent.TWO_PASS_MIN_LEVELS['varlen']; default: the package's)",
    )
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (--models tiny)")
    parser.add_argument("--dtype", choices=list(LOGPROB_BOUND), default=None,
                        help="the model's dtype (default: bfloat16 on CUDA, float32 elsewhere)")  # fmt: skip
    parser.add_argument(
        "--perturb-tree",
        type=float,
        default=0.0,
        help="add noise of this relative size to the weights while the tree methods are scored (not timed): their "
        "agreement must then fail (the check's own check)",
    )
    parser.add_argument("--out", default="benchmarks/results/tree_vs_flat.json")
    args = parser.parse_args()
    global GDN_ROUTE
    stack = contextlib.ExitStack()
    if args.gdn_route != "installed":
        for name in args.models:
            head_dim = MODELS[name].get("linear_key_head_dim")
            if head_dim is not None and (reason := gdn_kernels.unavailable(args.gdn_route, head_dim, torch.bfloat16,
                                                                           lift_guard=True)):  # fmt: skip
                raise SystemExit(f"--gdn-route {args.gdn_route} cannot run {name} here: {reason}")
        GDN_ROUTE = args.gdn_route
        stack.enter_context(gdn_kernels.select(args.gdn_route, lift_guard=True))
    gdn_kernels.install_probes()
    if args.delta_rule_two_pass_from is not None:
        recurrent.TWO_PASS_MIN_LEVELS["varlen"] = args.delta_rule_two_pass_from

    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    MaskTimer.install()
    set_flex_kernel_options(args.flex_kernel_options)
    # Token ids of the workloads: below every model's vocab (Qwen3's, the smallest of the GPU models, unless --models
    # names a smaller one).
    vocab = min(MODELS[m]["vocab_size"] for m in ["qwen3-0.6b", *args.models])
    workloads = build_workloads(args.scale, vocab)
    if args.workloads:
        workloads = [w for w in [*workloads, smoke_workload(vocab)] if w.name in args.workloads]

    results = {
        **provenance(**{k: v for k, v in gdn_kernels.versions().items() if k not in ("torch", "transformers", "gpu")}),
        "gdn_route": args.gdn_route,
        "gdn_resolved": gdn_kernels.resolved_kernels(),
        "delta_rule_two_pass_from": recurrent.TWO_PASS_MIN_LEVELS["varlen"],
        "max_tokens_per_mb": args.max_tokens_per_mb,
        "kernels": {
            "liger": args.liger,
            "compile_layers": args.compile_layers,
            "checkpointing": args.checkpointing,
            "flex_kernel_options": args.flex_kernel_options,
        },
        "peak_flops": PEAK_FLOPS,
        "device": device.type,
        "dtype": dtype_name,
        "repeats": args.repeats,
        "perturb_tree": args.perturb_tree,
        "runs": [],
    }
    print(f"{'model':<12} {'workload':<22} {'tok ceil':>8} {'flop ceil':>9} {'vs padded':>9} {'vs packed':>9} "
          f"{'%ceil':>6} {'%flop':>6} {'mem/flat':>8} {'pack+mask':>9} {'grad cos':>8} {'mfu tree':>8} "
          f"{'flat':>6}")  # fmt: skip
    for name in args.models:
        model = build_model(
            name, device, args.liger, args.compile_layers, args.checkpointing, getattr(torch, dtype_name)
        )
        for wl in workloads:
            flops = hf_tree_attn.estimate_flops(model.config, wl.sequences, prompt_lengths=wl.prompt_lengths)
            run = {"model": name, "model_config": MODELS[name], "workload": wl.name, "spec": wl.spec,
                   "num_sequences": len(wl.sequences), "total_tokens": sum(map(len, wl.sequences)),
                   "token_ceiling": 1 / flops["token_ratio"], "flop_ceiling": 1 / flops["flops_ratio"]}  # fmt: skip
            probes = {}
            tree_fn = functools.partial(tree_step, recompute=args.checkpointing)
            methods = {**METHODS, "tree": tree_fn}
            hybrid = bool(tree_layer_types(model))
            if hybrid:
                methods["flat_packed"] = flat_packed_forest_step
            if flops["token_ratio"] > FALLBACK_RATIO:  # little sharing: the trainer's decision, and the forced tree
                methods["tree_forced"] = tree_fn
                methods["tree"] = functools.partial(tree_fn, fallback_ratio=FALLBACK_RATIO)
            if args.compare_flex:
                methods["tree_flex"] = without_prefix_kernels(methods["tree"])
            if args.compare_whole_recompute:
                methods["tree_whole_recompute"] = functools.partial(methods["tree"], keep_attention=False)
            for gib in args.compare_budget_gib:
                methods[f"tree_budget_{gib:g}gib"] = functools.partial(methods["tree"], budget_gib=gib)
            scores = {}  # method -> sequence -> its scored log-probabilities (the probe step's policy forward)
            for method, fn in methods.items():
                run[method] = time_method(fn, model, wl, args.max_tokens_per_mb, device, args.repeats)
                scores[method] = {}
                with perturbed(model, args.perturb_tree if method.startswith("tree") else 0.0):
                    probes[method] = grad_probe(model, fn, wl, args.max_tokens_per_mb, device, scores[method])
                run[method]["mfu"] = model_flops(method, run[method], flops) / run[method]["time_s"] / PEAK_FLOPS
            if hybrid and gdn_varlen(model, device):  # the cost of going level by level: same tokens and kernels, one
                # varlen call per layer
                one_level = functools.partial(tree_step, one_level=True)
                run["tree_one_level"] = time_method(one_level, model, wl, args.max_tokens_per_mb, device, args.repeats)
                run["level_overhead"] = 1 - run["tree_one_level"]["time_s"] / run["tree"]["time_s"]
            for method in [m for m in probes if m != "flat_padded"]:  # same loss, same weights: gradients must
                # agree (bf16 noise)
                cos = torch.nn.functional.cosine_similarity(probes[method], probes["flat_padded"], dim=0)
                run[method]["grad_cos_vs_flat_padded"] = cos.item()
            del probes
            order = range(len(wl.sequences))  # every method's tokens in the same order
            scores = {m: torch.cat([per[i] for i in order if i in per]).tolist() for m, per in scores.items()}
            check_run(run, scores, dtype_name)
            del scores
            if graphs := torch._dynamo.utils.counters["stats"]["unique_graphs"]:
                run["compiled_graphs"] = int(graphs)
            best_flat = min(run["flat_padded"]["time_s"], run["flat_packed"]["time_s"])
            tree = run["tree"]
            run["speedup_vs_padded"] = run["flat_padded"]["time_s"] / tree["time_s"]
            run["speedup_vs_packed"] = run["flat_packed"]["time_s"] / tree["time_s"]
            run["speedup_vs_best_flat"] = best_flat / tree["time_s"]
            run["pct_of_token_ceiling"] = 100 * run["speedup_vs_best_flat"] / run["token_ceiling"]
            run["pct_of_flop_ceiling"] = 100 * run["speedup_vs_best_flat"] / run["flop_ceiling"]
            peaks = (run["flat_padded"]["peak_gib"], run["flat_packed"]["peak_gib"], tree["peak_gib"])
            run["peak_memory_ratio"] = None if None in peaks else tree["peak_gib"] / min(peaks[:2])  # None: not CUDA
            run["pack_and_mask_share"] = (tree["pack_s"] + tree["mask_s"]) / tree["time_s"]
            if args.compare_flex:
                run["speedup_vs_tree_flex"] = run["tree_flex"]["time_s"] / tree["time_s"]
            if args.compare_whole_recompute:
                run["speedup_vs_whole_recompute"] = run["tree_whole_recompute"]["time_s"] / tree["time_s"]
            best_flat_mfu = max(run["flat_padded"]["mfu"], run["flat_packed"]["mfu"])
            results["runs"].append(run)
            print(f"{name:<12} {wl.name:<22} {run['token_ceiling']:>7.2f}x {run['flop_ceiling']:>8.2f}x "
                  f"{run['speedup_vs_padded']:>8.2f}x {run['speedup_vs_packed']:>8.2f}x "
                  f"{run['pct_of_token_ceiling']:>5.0f}% {run['pct_of_flop_ceiling']:>5.0f}% "
                  + (f"{run['peak_memory_ratio']:>8.2f} " if run["peak_memory_ratio"] is not None else f"{'-':>8} ")
                  + f"{100 * run['pack_and_mask_share']:>8.1f}% {tree['grad_cos_vs_flat_padded']:>8.5f} "
                  f"{100 * tree['mfu']:>7.1f}% {100 * best_flat_mfu:>5.1f}%"
                  + (f"  levels {tree.get('levels')}" if hybrid else "")
                  + (f"  [{tree['gdn_kernels']}]" if "gdn_kernels" in tree else "")
                  + ("  KERNEL MISMATCH" if any("gdn_route_problem" in run[m] for m in methods) else "")
                  + (f", by level +{100 * run['level_overhead']:.1f}%" if "level_overhead" in run else "")
                  + (f"  vs tree_flex {run['speedup_vs_tree_flex']:.3f}x (mfu {100 * run['tree_flex']['mfu']:.1f}%)"
                     if args.compare_flex else "")
                  + (f"  vs whole recompute {run['speedup_vs_whole_recompute']:.3f}x (mfu "
                     f"{100 * run['tree_whole_recompute']['mfu']:.1f}%, peak {tree['peak_gib']:.1f} vs "
                     f"{run['tree_whole_recompute']['peak_gib']:.1f} GiB)" if args.compare_whole_recompute else ""),
                  flush=True)  # fmt: skip
            print(paired_summary(run), flush=True)
            for gib in args.compare_budget_gib:
                other = run[f"tree_budget_{gib:g}gib"]
                print(f"  tree_activation_budget_gib={gib:g}: {tree['time_s'] / other['time_s']:.3f}x the default's "
                      f"speed, mfu {100 * other['mfu']:.1f}%, {100 * other.get('checkpointed_layers', 1):.0f}% of "
                      f"layers checkpointed, peak {other['peak_gib']:.1f} GiB (default {tree['peak_gib']:.1f}, flat "
                      f"padded {run['flat_padded']['peak_gib']:.1f})", flush=True)  # fmt: skip
            results["fla_log"] = gdn_kernels.fla_log()
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        if args.e2e:
            results.setdefault("e2e", {})[name] = e2e_step(model, device, vocab)
            print("end-to-end GRPO step:", results["e2e"][name], flush=True)
        if args.recompile_check:
            results["recompile_check"] = recompile_check(model, args.max_tokens_per_mb, device, vocab)
            print("recompile check:", results["recompile_check"])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    stack.close()


if __name__ == "__main__":
    main()
