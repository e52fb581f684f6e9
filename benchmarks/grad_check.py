"""Each `bench_tree_vs_flat.py` method's gradients with Liger / compiled layers vs the same method eager (GPU).

The same weights (same seed), the same workload; methods run in the benchmark's order on one model object, so
compiled graphs made for earlier methods are there when later ones run. Per parameter group (input embedding,
first layer, last layer's down projection): the cosine to the eager method, and the norm ratio.

    python benchmarks/grad_check.py --model qwen3-8b --layers 8 --variants compile liger liger_compile
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from bench_tree_vs_flat import METHODS, MODELS, build_model, build_workloads, tree_step
from harness import provenance

GROUPS = {"embed": "embed_tokens", "layer0": "layers.0.", "last_down": "mlp.down_proj"}


def probes(model, fn, wl, budget, device) -> dict[str, torch.Tensor]:
    fn(model, wl, budget, device)
    last = f"layers.{model.config.num_hidden_layers - 1}."
    out = {}
    for group, key in GROUPS.items():
        grads = [
            (p.grad.float().flatten() if p.grad is not None else torch.zeros(p.numel(), device=device))
            for n, p in model.named_parameters()
            if key in n.replace("._orig_mod", "") and (group != "last_down" or last in n.replace("._orig_mod", ""))
        ]
        out[group] = torch.cat(grads).cpu().double()
    model.zero_grad(set_to_none=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (faster)")
    parser.add_argument("--workload", default="grpo_G16_P4096_C512")
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--checkpointing", default="auto")
    parser.add_argument("--variants", nargs="+", default=["compile", "liger", "liger_compile"])
    parser.add_argument("--methods", nargs="+", default=["flat_padded", "flat_packed", "tree", "tree_ckpt_all"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    name = args.model
    if args.layers:
        name = f"{args.model}-L{args.layers}"
        MODELS[name] = {**MODELS[args.model], "num_hidden_layers": args.layers}
    wl = next(w for w in build_workloads(args.scale, MODELS["qwen3-0.6b"]["vocab_size"]) if w.name == args.workload)
    methods = {
        "flat_padded": METHODS["flat_padded"],
        "flat_packed": METHODS["flat_packed"],
        "tree": functools.partial(tree_step, recompute=args.checkpointing),
        "tree_ckpt_all": functools.partial(tree_step, recompute="all"),
    }
    methods = {m: methods[m] for m in args.methods}
    budget = 65536

    # Eager first: Liger patches transformers' module functions for every model built afterwards.
    model = build_model(name, device, checkpointing=args.checkpointing)
    reference = {m: probes(model, fn, wl, budget, device) for m, fn in methods.items()}
    del model
    torch.cuda.empty_cache()
    results = {**provenance(), "eager": {}}
    for m in methods:
        results["eager"][m] = {
            g: torch.nn.functional.cosine_similarity(reference[m][g], reference[args.methods[0]][g], dim=0).item()
            for g in GROUPS
        }
        print(f"eager {m:<14} cos vs eager", args.methods[0], {g: round(c, 5) for g, c in results["eager"][m].items()})
    for variant in args.variants:
        torch._dynamo.reset()
        model = build_model(name, device, "liger" in variant, "compile" in variant, args.checkpointing)
        results[variant] = {}
        for m, fn in methods.items():
            fn(model, wl, budget, device)  # as the benchmark: a warm-up step, then the probed one
            model.zero_grad(set_to_none=True)
            got = probes(model, fn, wl, budget, device)
            results[variant][m] = {
                g: {
                    "cos": torch.nn.functional.cosine_similarity(got[g], reference[m][g], dim=0).item(),
                    "norm_ratio": (got[g].norm() / reference[m][g].norm()).item(),
                }
                for g in GROUPS
            }
            shown = {g: (round(v["cos"], 5), round(v["norm_ratio"], 4)) for g, v in results[variant][m].items()}
            print(f"{variant:<14} {m:<14} vs eager (cos, norm ratio)", shown, flush=True)
        del model
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
