"""benchmarks/flex_kernel_configs.py: the settings of inductor's FlexAttention kernels, read from generated Triton
code laid out as inductor writes its templates (`select_algorithm`: the `triton_heuristics.template` decorator, then
`NAME : tl.constexpr = value` lines in the kernel's body)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import flex_kernel_configs as configs  # noqa: E402


def _kernel(name: str, warps: int, stages: int, divisible: bool, block_n: int, hinted=(0, 1, 2, 3)) -> str:
    """A template kernel as inductor writes it; `hinted`: the argument indices with the divisibility hint (of
    `arg_Q, arg_K, arg_V, out_ptr0, ks0`)."""
    configs = {(i,): [["tt.divisibility", 16]] for i in hinted}
    return f"""
@triton_heuristics.template(
    num_stages={stages},
    num_warps={warps},
    triton_meta={{'signature': {{'arg_Q': '*bf16', 'arg_K': '*bf16', 'arg_V': '*bf16', 'out_ptr0': '*bf16', \
'ks0': 'i32'}}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90), \
'constants': {{}}, 'configs': [{configs!r}], 'num_warps': 99}},
    inductor_meta={{'kernel_name': '{name}', 'config_args': {{'num_warps': 77}}}},
)
@triton.jit
def {name}(arg_Q, arg_K, arg_V, out_ptr0, ks0):
    PRESCALE_QK : tl.constexpr = False
    IS_DIVISIBLE : tl.constexpr = {divisible}
    SM_SCALE : tl.constexpr = 0.08838834764831843
    BLOCK_M : tl.constexpr = 128
    BLOCK_N : tl.constexpr = {block_n}
    INDEX_DTYPE : tl.constexpr = tl.int32
    q = tl.load(arg_Q)
"""


def test_each_flex_kernel_its_launch_settings_and_flags(tmp_path):
    text = (
        _kernel("triton_tem_fused_flex_attention_0", 4, 3, False, 64)
        + "\n@triton_heuristics.pointwise(size_hints={'x': 1024})\n@triton.jit\ndef triton_poi_fused_mul_0(in_ptr0):\n"
        "    XBLOCK : tl.constexpr = 1024\n"
        + _kernel("triton_tem_fused__to_copy_add_flex_attention_mean_rsqrt_3", 8, 2, True, 32, hinted=(0, 2, 4))
    )
    kernels = configs.kernels_in(text)
    assert [k["name"] for k in kernels] == [
        "triton_tem_fused_flex_attention_0", "triton_tem_fused__to_copy_add_flex_attention_mean_rsqrt_3",
    ]  # fmt: skip
    first, second = kernels
    assert (first["num_warps"], first["num_stages"], second["num_warps"], second["num_stages"]) == (4, 3, 8, 2)
    assert first["constexprs"]["IS_DIVISIBLE"] == "False" and second["constexprs"]["IS_DIVISIBLE"] == "True"
    assert first["constexprs"]["BLOCK_N"] == "64" and second["constexprs"]["BLOCK_N"] == "32"
    assert "XBLOCK" not in first["constexprs"]  # the pointwise kernel's lines are not the template's
    assert first["not_divisible_by_16"] == ["ks0"] and second["not_divisible_by_16"] == ["arg_K", "out_ptr0"]

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "k.py").write_text(text)
    (tmp_path / "b.py").write_text(_kernel("triton_tem_fused_flex_attention_0", 4, 3, False, 64))
    (tmp_path / "c.py").write_text("def unrelated():\n    pass\n")
    scanned = configs.scan(tmp_path)
    assert sorted((k["name"], k["files"]) for k in scanned) == [
        ("triton_tem_fused__to_copy_add_flex_attention_mean_rsqrt_3", 1), ("triton_tem_fused_flex_attention_0", 2),
    ]  # fmt: skip


def test_main_writes_each_labelled_cache_and_names_a_bad_argument(tmp_path, monkeypatch, capsys):
    (tmp_path / "eager").mkdir()
    (tmp_path / "eager" / "k.py").write_text(_kernel("triton_tem_fused_flex_attention_0", 4, 3, False, 64))
    out = tmp_path / "configs.json"
    monkeypatch.setattr(sys, "argv", ["x", f"eager={tmp_path / 'eager'}", "--out", str(out)])
    configs.main()
    written = json.loads(out.read_text())
    assert [k["num_warps"] for k in written["runs"]["eager"]] == [4]
    assert written["command"].startswith("python x eager=")  # with its provenance (argv[0] is "x" here)
    assert {"git_commit", "versions", "gpu"} <= set(written)
    for bad, named in ((str(tmp_path), "is not LABEL=DIR"), (f"x={tmp_path / 'none'}", "is no directory")):
        monkeypatch.setattr(sys, "argv", ["x", bad, "--out", str(out)])
        with pytest.raises(SystemExit, match=named):
            configs.main()
