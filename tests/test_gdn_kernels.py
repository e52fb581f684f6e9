"""The kernel-route harness of the GPU tests and benchmarks (`benchmarks/gdn_kernels.py`), on CPU: switching a
Gated DeltaNet model to transformers' torch reference and back, and the call counts that tell which kernels ran.
The GPU routes themselves (FlashQLA, fla's Triton and TileLang kernels) are tested in test_gpu_recurrent.py."""

import sys
from collections import Counter
from pathlib import Path

import torch
from helpers import forest_case, hybrid_twin_models

import hf_tree_attn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gdn_kernels  # noqa: E402

MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"


def test_torch_route_runs_the_reference_and_the_probe_sees_it():
    tree_model, flat_model = hybrid_twin_models("qwen3_5")
    seqs = forest_case("grpo", seed=0)
    resolved = gdn_kernels.resolved_kernels()[MODULE]
    with gdn_kernels.select("torch"):
        assert gdn_kernels.resolved_kernels()[MODULE] == f"{MODULE}.torch_chunk_gated_delta_rule"
        with gdn_kernels.KernelProbe() as probe:
            logps = hf_tree_attn.sequence_logprobs(tree_model, seqs)
            sum(lp.sum() for lp in logps).backward()
        with gdn_kernels.KernelProbe() as flat_probe, torch.no_grad():
            flat_model(torch.tensor([seqs[0]]))
    assert gdn_kernels.resolved_kernels()[MODULE] == resolved  # restored
    levels = max(f.num_levels for f in hf_tree_attn.pack_forest(seqs))
    layers = sum(t == "linear_attention" for t in tree_model.config.layer_types)
    assert probe.calls["gdn_layer_tree"] == layers
    assert probe.calls["torch_reference"] == layers * levels  # one call per level and layer
    assert flat_probe.calls["gdn_layer_flat"] == layers and flat_probe.calls["torch_reference"] == layers
    assert gdn_kernels.route_problem("torch", probe.calls) is None
    assert "torch reference" in gdn_kernels.describe(probe.calls)
    for route in gdn_kernels.FLA_ROUTES:  # these calls are no fla kernel's
        assert gdn_kernels.route_problem(route, probe.calls) is not None


def test_route_problem_names_a_silent_fallback():
    flash_qla = Counter(flash_qla_fwd=3, flash_qla_bwd=3)
    assert gdn_kernels.route_problem("flash_qla", flash_qla) is None
    assert gdn_kernels.route_problem("flash_qla", flash_qla + Counter(fla_triton_fwd=1)) is not None
    assert gdn_kernels.route_problem("flash_qla", Counter(flash_qla_fwd=3)) is not None  # no backward
    assert gdn_kernels.route_problem("flash_qla", Counter(flash_qla_fwd=3), backward=False) is None
    tilelang = Counter(fla_triton_fwd=3, fla_triton_bwd=3, tilelang_dqkwg=3)
    assert gdn_kernels.route_problem("fla_tilelang", tilelang) is None
    assert gdn_kernels.route_problem("fla_tilelang", tilelang - Counter(tilelang_dqkwg=1)) is not None
    assert gdn_kernels.route_problem("fla_triton", tilelang) is not None
    assert gdn_kernels.route_problem("fla_triton", Counter(fla_triton_fwd=3, fla_triton_bwd=3)) is None
    assert "dqkwg on TileLang in 3 of 3" in gdn_kernels.describe(tilelang)
