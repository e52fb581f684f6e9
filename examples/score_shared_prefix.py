"""Score many completions of one prompt in one tree forward, and check the result against plain forwards.

    python examples/score_shared_prefix.py                     # tiny random Qwen3 built from a config, CPU, seconds
    python examples/score_shared_prefix.py --model_name_or_path Qwen/Qwen3-0.6B --num_completions 8

The model is loaded once with `attn_implementation="tree_flex"`; the same object samples the completions
(`generate` behaves exactly like `sdpa`) and scores them packed as a prefix tree with
`hf_tree_attn.sequence_logprobs`: the prompt is computed once instead of `num_completions` times. Every
per-token log-probability is then recomputed by a plain forward of each sequence on its own; the script exits
with status 1 if the two differ by more than `--atol`.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

import hf_tree_attn


def tiny_model() -> torch.nn.Module:
    """A 2-layer Qwen3 with random weights, built from a config (no download)."""
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="tree_flex")


def load(args) -> tuple[torch.nn.Module, torch.Tensor, int | None]:
    """The model, the prompt `(1, P)` token ids, and the id that ends a completion (None: none)."""
    if args.model_name_or_path is None:
        model = tiny_model()
        prompt = torch.randint(1, model.config.vocab_size, (1, args.prompt_length))
        return model, prompt, None
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, attn_implementation="tree_flex", dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    messages = [{"role": "user", "content": args.prompt}]
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    else:
        prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
    return model, prompt, tokenizer.eos_token_id


def sample_completions(model, prompt: torch.Tensor, args, eos_id: int | None) -> list[list[int]]:
    """`num_completions` sampled sequences (prompt + completion, cut after the first eos)."""
    out = model.generate(
        prompt.repeat(args.num_completions, 1),
        attention_mask=torch.ones(args.num_completions, prompt.shape[1], dtype=torch.long),
        do_sample=True,
        max_new_tokens=args.max_new_tokens,
        pad_token_id=eos_id if eos_id is not None else 0,
        eos_token_id=eos_id,
    )
    sequences = []
    for row in out.tolist():
        completion = row[prompt.shape[1] :]
        if eos_id is not None and eos_id in completion:
            completion = completion[: completion.index(eos_id) + 1]
        sequences.append(row[: prompt.shape[1]] + completion)
    return sequences


@torch.no_grad()
def plain_logprobs(model, sequence: list[int]) -> torch.Tensor:
    """Reference: log p(tok_t | tok_<t), t = 1..L-1, from an ordinary forward of the sequence alone."""
    ids = torch.tensor([sequence])
    logits = model(input_ids=ids).logits[0, :-1].float()  # (L-1, vocab)
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", default=None, help="default: a tiny random Qwen3 (no download)")
    parser.add_argument("--prompt", default="Write a haiku about sharing.", help="prompt text (real models only)")
    parser.add_argument("--prompt_length", type=int, default=96, help="random prompt tokens (tiny model only)")
    parser.add_argument("--num_completions", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--atol", type=float, default=1e-4, help="largest allowed |tree - plain| per-token logprob")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model, prompt, eos_id = load(args)
    model.eval()
    sequences = sample_completions(model, prompt, args, eos_id)
    prompt_len = prompt.shape[1]

    with torch.no_grad():
        tree = hf_tree_attn.sequence_logprobs(model, sequences)  # one forward, prompt computed once
    plain = [plain_logprobs(model, seq) for seq in sequences]  # one forward per sequence

    # logps[i][t - 1] scores token t, so the completion's tokens start at index prompt_len - 1.
    print(f"prompt: {prompt_len} tokens, {len(sequences)} completions")
    print(f"{'seq':>3} {'completion tokens':>17} {'logp total (tree)':>18} {'logp total (plain)':>19}")
    for i, seq in enumerate(sequences):
        tree_total = tree[i][prompt_len - 1 :].sum().item()
        plain_total = plain[i][prompt_len - 1 :].sum().item()
        print(f"{i:>3} {len(seq) - prompt_len:>17} {tree_total:>18.4f} {plain_total:>19.4f}")

    ratio = hf_tree_attn.tree_token_ratio(sequences)
    (forest,) = hf_tree_attn.pack_forest(sequences)
    flops = hf_tree_attn.estimate_flops(model.config, sequences, prompt_lengths=[prompt_len] * len(sequences))
    print(
        f"tree_token_ratio = {ratio:.3f} ({forest.num_tree_tokens} unique of {forest.num_original_tokens} tokens; "
        f"1/G = {1 / len(sequences):.3f} would be perfect sharing)"
    )
    print(f"estimated forward FLOPs saved by the tree: {flops['flops_saved']:.1%}")

    max_diff = max((t - p).abs().max().item() for t, p in zip(tree, plain))
    ok = max_diff <= args.atol
    print(f"max |tree - plain| per-token logprob = {max_diff:.2e} (atol {args.atol:.0e}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
