"""The seam to transformers' modeling modules (`hf_tree_attn.transformers_compat`): the functions it replaces are
exactly the pinned set and exist in the installed transformers; `import hf_tree_attn` replaces none of them; a model
checked for trees, or a packed forest, replaces all of them, once; and with them replaced a forward without a tree is
bit-identical to transformers' own."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import transformers
from helpers import hybrid_twin_models

from hf_tree_attn import pack_forest, recurrent, transformers_compat
from hf_tree_attn.support import tree_support_error
from hf_tree_attn.transformers_compat import TRANSFORMERS_CHECKED, WRAPPED_FUNCTIONS, kernel_function

_MASK = "create_recurrent_attention_mask"
_GDN = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule", _MASK)
_KDA = ("causal_conv1d_fn", "chunk_kimi_delta_attention", _MASK)
_CONV = ("causal_conv1d_fn", _MASK)
_MAMBA2 = ("causal_conv1d_fn", "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined", _MASK)
# family → the functions replaced in `transformers.models.<family>.modeling_<family>`, read in transformers 5.24.0
# and 5.25.0.
EXPECTED = {
    "qwen3_5": _GDN,
    "qwen3_5_moe": _GDN,
    "qwen3_next": _GDN,
    "olmo_hybrid": _GDN,
    "lara_mini": _GDN,
    "kimi_linear": _KDA,
    "bailing_hybrid": _KDA,
    "lfm2": _CONV,
    "lfm2_moe": _CONV,
    "lfm3": _CONV,
    "zamba2": _MAMBA2,
    "nemotron_h": _MAMBA2,
    "bamba": _MAMBA2,
    "granitemoehybrid": _MAMBA2,
    "falcon_h1": _MAMBA2,
}
ONE_PER_KIND = ("qwen3_5", "kimi_linear", "lfm2", "nemotron_h")


def replaced() -> list[str]:
    """The functions of the loaded transformers modules that are tree dispatchers, as `module.name`."""
    return sorted(
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        if name.startswith("transformers") and module is not None
        for attr, value in list(vars(module).items())
        if isinstance(value, types.FunctionType) and hasattr(value, "tree_original")
    )


def _targets() -> set[str]:
    return {f"{entry.module}.{entry.attribute}" for entry in WRAPPED_FUNCTIONS}


def _served() -> list:
    """The entries the installed transformers has (the others are reported to the gate, not replaced)."""
    return [entry for entry in WRAPPED_FUNCTIONS if transformers.__version__ in entry.checked_on]


@pytest.fixture
def uninstalled(monkeypatch):
    """transformers' own functions back in place and `install()` not yet run; the dispatchers return after."""
    transformers_compat.install()
    for entry in WRAPPED_FUNCTIONS:
        module = sys.modules.get(entry.module)
        current = getattr(module, entry.attribute, None)
        if current is not None and hasattr(current, "tree_original"):
            monkeypatch.setattr(module, entry.attribute, current.tree_original)
    monkeypatch.setattr(transformers_compat, "_installed", False)
    assert replaced() == []


def test_the_table_is_the_pinned_set():
    want = {
        f"transformers.models.{family}.modeling_{family}.{attribute}"
        for family, attributes in EXPECTED.items()
        for attribute in attributes
    }
    assert _targets() == want
    assert len(WRAPPED_FUNCTIONS) == len(want)  # no target listed twice
    for entry in WRAPPED_FUNCTIONS:
        assert entry.checked_on[-1] == TRANSFORMERS_CHECKED
        assert f"{entry.module}.{entry.layer}" in recurrent.TREE_LAYERS
        assert (entry.tree_version is None) == (entry.attribute == _MASK)


def test_every_target_exists_in_the_installed_transformers_and_is_replaced():
    read_in = {version for entry in WRAPPED_FUNCTIONS for version in entry.checked_on}
    assert transformers.__version__ in read_in, (
        f"transformers {transformers.__version__}: the table was read in {sorted(read_in)} only. Read each target "
        "in this release (module, function, the layer's call with the model kwargs) and add it to `checked_on`."
    )
    transformers_compat.install()
    served = _served()
    if transformers.__version__ == TRANSFORMERS_CHECKED:
        assert len(served) == len(WRAPPED_FUNCTIONS)
    for entry in served:
        function = getattr(sys.modules[entry.module], entry.attribute)
        original = function.tree_original
        assert callable(original) and not hasattr(original, "tree_original")
        # transformers' own (from 5.25 a `kernels` module instance around it), under the name the layers call
        assert kernel_function(original).__name__ == entry.attribute
        assert f"{entry.module}.{entry.layer}" not in recurrent._UNAVAILABLE
    for entry in set(WRAPPED_FUNCTIONS) - set(served):  # a family this transformers lacks: refused, by the gate
        assert f"{entry.module}.{entry.layer}" in recurrent._UNAVAILABLE
    assert set(replaced()) == {f"{e.module}.{e.attribute}" for e in served}


def test_a_bare_import_replaces_no_transformers_function():
    after_import = textwrap.dedent(
        """
        import hf_tree_attn
        from hf_tree_attn.transformers_compat import WRAPPED_FUNCTIONS
        assert replaced() == [], replaced()
        assert not {e.module for e in WRAPPED_FUNCTIONS} & set(sys.modules)  # not even imported
        hf_tree_attn.pack_forest([[5, 6, 7, 8], [5, 6, 9]])
        print(len(replaced()))
        """
    )
    script = "import sys, types\n" + inspect.getsource(replaced) + after_import
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == len(_served())


def test_packing_a_forest_replaces_them(uninstalled):
    pack_forest([[5, 6, 7, 8], [5, 6, 9]])
    assert set(replaced()) == {f"{e.module}.{e.attribute}" for e in _served()}


def test_checking_a_model_for_trees_replaces_them(uninstalled):
    tree, _ = hybrid_twin_models("lfm2")  # built before: the layers look the functions up at every call
    assert tree_support_error(tree) is None
    assert set(replaced()) == {f"{e.module}.{e.attribute}" for e in _served()}


def test_install_is_idempotent(monkeypatch):
    transformers_compat.install()
    before = replaced()
    functions = {name: getattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1]) for name in before}
    monkeypatch.setattr(transformers_compat, "_installed", False)  # not only the flag: the functions themselves
    transformers_compat.install()
    assert replaced() == before
    for name, function in functions.items():
        now = getattr(sys.modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1])
        assert now is function and not hasattr(now.tree_original, "tree_original")


@pytest.mark.parametrize("family", ONE_PER_KIND)
def test_a_forward_without_a_tree_is_bit_identical_with_them_replaced(family, monkeypatch):
    """Padded (left padding: `create_recurrent_attention_mask` zeroes it) and unpadded, with and without grad."""
    transformers_compat.install()
    tree, _ = hybrid_twin_models(family)
    module = sys.modules[type(tree).__module__]
    dispatchers = {name: fn for name, fn in vars(module).items() if isinstance(fn, types.FunctionType)}
    dispatchers = {name: fn for name, fn in dispatchers.items() if hasattr(fn, "tree_original")}
    assert set(dispatchers) == set(EXPECTED[family])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :9] = 0, 0

    def run():
        padded = tree(input_ids=ids, attention_mask=mask).logits
        plain = tree(input_ids=ids[:1]).logits
        grads = torch.autograd.grad(plain.square().sum(), list(tree.parameters()), allow_unused=True)
        return [padded, plain, *(x for x in grads if x is not None)]

    got = run()
    for name, fn in dispatchers.items():
        monkeypatch.setattr(module, name, fn.tree_original)
    want = run()
    assert len(got) == len(want) > 2
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _fake_modeling_module(passes_on: bool, tmp_path, monkeypatch) -> types.ModuleType:
    """A modeling module shaped like transformers 5.25's: the layer reaches `causal_conv1d_fn` through the module's
    `causal_conv1d_forward`, which passes the model kwargs on (or, `passes_on=False`, drops them). Written to a file:
    the check reads the functions' source."""
    conv_call = "causal_conv1d_fn(x, weight, None, **kwargs)" if passes_on else "causal_conv1d_fn(x, weight, None)"
    name = f"fake_modeling_{passes_on}"
    source = f"""
        import torch

        def causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs):
            return x

        def causal_conv1d_forward(conv1d, x, cache, layer_idx, **kwargs):
            weight = conv1d.weight
            return {conv_call}

        class FakeShortConv(torch.nn.Module):
            def forward(self, x, **kwargs):
                return causal_conv1d_forward(self.conv, x, None, 0, **kwargs)
        """
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


@pytest.mark.parametrize("passes_on", [True, False])
def test_a_target_reached_through_an_intermediate_function_needs_the_kwargs_all_the_way(
    passes_on, tmp_path, monkeypatch
):
    module = _fake_modeling_module(passes_on, tmp_path, monkeypatch)
    entry = transformers_compat.WrappedFunction(
        module.__name__, "causal_conv1d_fn", "FakeShortConv", "", (TRANSFORMERS_CHECKED,), lambda *a: None
    )
    why = transformers_compat._kwargs_break(module, entry)
    if passes_on:
        assert why is None
    else:
        assert why is not None and "`causal_conv1d_forward` does not pass the model kwargs on to" in why


def test_kernel_function_is_the_function_behind_a_kernels_module():
    kernels = pytest.importorskip("kernels")

    def conv(x, weight, bias=None, **kwargs):
        return x

    func_module = kernels.use_kernel_forward_from_hub("conv")(conv)
    assert isinstance(func_module, torch.nn.Module)
    assert kernel_function(func_module) is conv
    assert kernel_function(conv) is conv
