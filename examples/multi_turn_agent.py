"""Train on multi-turn agent conversations stored one sample per turn, packed as prefix trees.

    python examples/multi_turn_agent.py                 # tiny random Qwen3, synthetic conversations, CPU, seconds

Agent data is often stored one sample per turn: sample `t` is the whole history up to turn `t` plus the
assistant's turn-`t` response, and several responses are sampled per turn (branches). The history drops the
earlier `<think>` blocks (as Qwen3's chat template does), so a turn's sample branches off the previous one
right where that `<think>` began. Flat training recomputes the system prompt and history in every sample; the
tree computes each of them once.

The script builds such samples (character-level token ids, so you can read them), packs them with
`hf_tree_attn.TreeDataCollator`, prints what the tree saves, and trains a few steps with a per-token loss mask
that trains only the assistant's own response in each sample. It checks that the first step's tree loss and
gradients equal those of plain per-sample forwards, and that the loss goes down; it exits with status 1 if
not.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import hf_tree_attn
from hf_tree_attn import TreeDataCollator

SYSTEM = (
    "<|system|>You are a shell agent. Think inside <think></think>, then call exactly one tool: ls <dir>, "
    "cat <file>, grep <word> <file> or answer <text>. Keep every thought short and never guess a file name.\n"
)
WORDS = ["alpha", "beta", "gamma", "delta", "notes", "todo", "src", "docs", "main", "test", "data", "config", "log"]
TOOLS = ("ls", "cat", "grep")


def response(rng: random.Random) -> str:
    """One assistant turn: a thought, then a tool call."""
    thought = " ".join(rng.choices(WORDS, k=rng.randint(3, 6)))
    call = f"{rng.choice(TOOLS)} {rng.choice(WORDS)}/{rng.choice(WORDS)}"
    return f"<think>{thought}</think>{call}\n"


def without_think(text: str) -> str:
    """How a past assistant turn appears in later history: its <think> block dropped."""
    return text[text.index("</think>") + len("</think>") :]


def conversation_samples(rng: random.Random, turns: int, branches: int) -> list[dict]:
    """One conversation as per-turn samples: `input_ids` (char codes) and `loss_mask` (1 = the response)."""
    samples, history = [], SYSTEM + f"<|user|>find the {rng.choice(WORDS)} file and tell me what it says\n"
    for _ in range(turns):
        responses = [response(rng) for _ in range(branches)]  # sampled alternatives for this turn
        prompt = history + "<|assistant|>"
        for text in responses:
            ids = [ord(c) for c in prompt + text]
            mask = [0] * len(prompt) + [1] * len(text)
            samples.append({"input_ids": ids, "loss_mask": mask})
        # The conversation continues with the first response; the tool answers.
        tool_output = " ".join(rng.choices(WORDS, k=rng.randint(4, 10)))
        history = prompt + without_think(responses[0]) + f"<|tool|>{tool_output}\n"
    return samples


def tiny_model(seed: int) -> torch.nn.Module:
    """A 2-layer Qwen3 over the 128 ASCII codes, random weights, built from a config (no download)."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex")


def tree_loss(model, micro_batches) -> torch.Tensor:
    """Mean negative log-likelihood of the masked tokens, one forward per micro-batch (backward inside)."""
    num_trained = sum(mb.fields["loss_mask"].sum() for mb in micro_batches)
    total = 0.0
    for mb in micro_batches:
        table, _ = hf_tree_attn.forest_logprobs(model, mb.forest)  # (S,) logp of each row's token, given its parent
        logps = mb.gather(table)  # (N,) one entry per token of every packed sample
        loss = -(logps * mb.fields["loss_mask"]).sum() / num_trained
        loss.backward()  # accumulate gradients micro-batch by micro-batch
        total += loss.item()
    return total


def flat_loss(model, samples) -> float:
    """Reference: the same loss from one plain forward per sample (what training without trees does)."""
    num_trained = sum(sum(s["loss_mask"]) for s in samples)
    total = 0.0
    for sample in samples:
        ids = torch.tensor([sample["input_ids"]])
        logps = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        loss = -(logps * torch.tensor(sample["loss_mask"][1:])).sum() / num_trained
        loss.backward()
        total += loss.item()
    return total


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--branches", type=int, default=2, help="responses sampled per turn")
    parser.add_argument("--max_tokens_per_mb", type=int, default=2048, help="a multiple of 128")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    samples = [s for _ in range(args.conversations) for s in conversation_samples(rng, args.turns, args.branches)]
    sequences = [s["input_ids"] for s in samples]
    example = samples[args.branches + 1]  # turn 1, branch 1 of the first conversation
    shown = "".join(chr(t) if not m else chr(t).upper() for t, m in zip(example["input_ids"], example["loss_mask"]))
    print(
        f"{len(samples)} samples ({args.conversations} conversations x {args.turns} turns x {args.branches} "
        "responses). One of them, trained tokens in CAPITALS:"
    )
    print("  " + shown.replace("\n", "\n  "))

    # Every conversation starts with the same system prompt, so all samples form one trie; the collator cuts it
    # into micro-batches of at most max_tokens_per_mb. Per-token fields (`loss_mask`) follow their tokens into
    # `mb.fields`, one entry per token of every packed sample (a row shared by several samples appears once per
    # sample there, so each sample keeps its own mask value).
    collator = TreeDataCollator(max_tokens_per_mb=args.max_tokens_per_mb)
    micro_batches = collator(samples)

    flat_tokens = sum(map(len, sequences))
    flat_padded = len(sequences) * max(map(len, sequences))
    tree_tokens = sum(mb.forest.num_tree_tokens for mb in micro_batches)
    tree_padded = sum(mb.forest.seq_len for mb in micro_batches)
    model = tiny_model(args.seed)
    flops = hf_tree_attn.estimate_flops(model.config, sequences)
    print(f"flat: {flat_tokens} tokens in {len(sequences)} rows ({flat_padded} as one padded batch)")
    print(f"tree: {tree_tokens} unique tokens in {len(micro_batches)} micro-batches ({tree_padded} padded to 128)")
    print(
        f"tree_token_ratio = {hf_tree_attn.tree_token_ratio(sequences):.3f} over all samples, "
        f"{tree_tokens / flat_tokens:.3f} as packed into micro-batches; "
        f"estimated forward FLOPs saved: {flops['flops_saved']:.1%}"
    )

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    flat_value = flat_loss(model, samples)
    flat_grads = grads(model)
    model.zero_grad()

    losses = []
    for step in range(args.steps):
        losses.append(tree_loss(model, micro_batches))
        if step == 0:
            loss_diff = abs(losses[0] - flat_value)
            grad_diff = max((g - f).abs().max().item() for g, f in zip(grads(model), flat_grads))
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {losses[-1]:.4f}")

    ok_match = loss_diff <= 1e-4 and grad_diff <= 1e-4
    ok_learn = losses[-1] < losses[0]
    print(
        f"step 0 vs plain per-sample forwards: |loss diff| = {loss_diff:.2e}, max |grad diff| = {grad_diff:.2e}: "
        f"{'OK' if ok_match else 'FAIL'}"
    )
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}: {'OK' if ok_learn else 'FAIL'}")
    return 0 if ok_match and ok_learn else 1


if __name__ == "__main__":
    sys.exit(main())
