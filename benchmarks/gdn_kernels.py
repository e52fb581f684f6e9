"""Gated DeltaNet kernel routes on CUDA: pick the kernels transformers' Qwen3.5 / Qwen3-Next layers run, and record
the kernels that really ran.

transformers resolves `torch_chunk_gated_delta_rule` once, when the modeling module is imported
(`use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`, the same in transformers 5.17 and 5.24):
flash-linear-attention's `fla.ops.gated_delta_rule.chunk_gated_delta_rule` when `import fla` succeeds, its torch
reference otherwise (an import error is swallowed). fla (0.6) then dispatches at every call, reading environment
variables at call time (`fla/backends.py`), so one process can switch routes:

  torch         transformers' torch reference (the modeling module's function swapped for it; the tree then runs
                zero-padded level batches, as on CPU)
  flash_qla     FlashQLA (`flash-qla`, TileLang; fla's `flash_qla` backend, `FLA_FLASH_QLA`, on by default when
                installed): the whole chunked gated delta rule, forward and backward, in its own kernels; fla gives
                it bf16 / fp16 calls with K = V = 128 on SM90 / SM100 and runs everything else itself
  fla_tilelang  fla's Triton kernels with the gated `chunk_bwd_dqkwg` on TileLang (`FLA_FLASH_QLA=0`,
                `FLA_TILELANG=1`; fla enables that backend by default on Hopper with Triton >= 3.4, where its Triton
                version miscompiles, once `tilelang` imports and nvcc is found)
  fla_triton    fla's Triton kernels alone (`FLA_FLASH_QLA=0 FLA_TILELANG=0`). fla 0.6 refuses the gated dqkwg
                backward on Hopper with 3.4 <= Triton < 3.7.1 (fla#640: its BK = 64 tile gives wrong gradients;
                32 and 128 pass). On Hopper fla tiles BK = min(next_pow2(K), 128), so at K = 128 the kernel runs the
                128 tile: `lift_guard=True` lifts the refusal (for K >= 128 only) and the comparison with the torch
                reference decides. fla 0.4.2 has no such refusal.

`install_probes()` wraps the kernel entry points (fla's Triton forward / backward, fla's TileLang dqkwg, FlashQLA's
forward / backward, the Gated DeltaNet calls of each modeling module) with call counters; `KernelProbe` reads the
counts of a block of code and `route_problem` says whether they show the route's kernels.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import shutil
import sys
from collections import Counter
from unittest import mock

import torch

from hf_tree_attn import recurrent, transformers_compat

__all__ = [
    "FLA_ROUTES",
    "ROUTES",
    "KernelProbe",
    "describe",
    "fla_log",
    "install_probes",
    "resolved_kernels",
    "route_problem",
    "select",
    "unavailable",
    "versions",
]

ROUTES = ("torch", "flash_qla", "fla_tilelang", "fla_triton")
FLA_ROUTES = ROUTES[1:]

# The modeling modules whose Gated DeltaNet layers the tree runs (recurrent.TREE_LAYERS, kind gated_delta_rule).
_GDN_MODULES = sorted(
    {path.rsplit(".", 1)[0] for path, kind in recurrent.TREE_LAYERS.items() if kind == "gated_delta_rule"}
)
_GDN_FUNCTION = "torch_chunk_gated_delta_rule"

# name -> calls since the probes were installed
CALLS: Counter = Counter()


def _counting(name: str, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)

    counted.probe_name = name
    return counted


def _wrap(module, attr: str, name: str) -> None:
    current = getattr(module, attr, None)
    if current is not None and getattr(current, "probe_name", None) != name:
        setattr(module, attr, _counting(name, current))


def _gdn_modules() -> list:
    """The imported Gated DeltaNet modeling modules that carry the tree's wrapper."""
    transformers_compat.install()
    modules = (sys.modules.get(name) for name in _GDN_MODULES)
    return [m for m in modules if m is not None and hasattr(getattr(m, _GDN_FUNCTION, None), "tree_original")]


def _layer_counter(module):
    """The modeling module's Gated DeltaNet call (the tree's dispatch), counting tree and flat calls; keeps
    `tree_original`, which `functools.wraps` copies."""
    dispatch = getattr(module, _GDN_FUNCTION)

    @functools.wraps(dispatch)
    def layer(*args, **kwargs):
        CALLS["gdn_layer_tree" if kwargs.get("tree_forest") is not None else "gdn_layer_flat"] += 1
        return dispatch(*args, **kwargs)

    layer.probe_name = "gdn_layer"  # (functools.wraps copied the dispatch's attributes, `probe_name` too)
    return layer


def install_probes() -> None:
    """Wrap every kernel entry point that is importable here with a call counter (idempotent). Imports fla, FlashQLA
    and fla's TileLang backend where they are installed (FlashQLA and TileLang need CUDA)."""
    for module in _gdn_modules():
        if getattr(getattr(module, _GDN_FUNCTION), "probe_name", None) != "gdn_layer":
            setattr(module, _GDN_FUNCTION, _layer_counter(module))
    if importlib.util.find_spec("fla") is None or _import_error("fla") is not None:
        return  # `unavailable` says why
    fla_log()  # listen before fla logs its first dispatch decision
    _probe("fla.ops.gated_delta_rule.chunk", {"chunk_gated_delta_rule_fwd": "fla_triton_fwd",
                                             "chunk_gated_delta_rule_bwd": "fla_triton_bwd"})  # fmt: skip
    if not torch.cuda.is_available():
        return
    if _has_module("tilelang") and _has_module("fla.ops.common.backends.tilelang"):
        _probe("fla.ops.common.backends.tilelang.chunk_bwd", {"chunk_bwd_dqkwg_tilelang": "tilelang_dqkwg"})
    if _has_module("flash_qla"):
        _probe("flash_qla.ops.gated_delta_rule.chunk", {"chunk_gated_delta_rule_fwd": "flash_qla_fwd",
                                                        "chunk_gated_delta_rule_bwd": "flash_qla_bwd"})  # fmt: skip


PROBE_ERRORS: dict[str, str] = {}  # module -> why its kernels could not be probed (it does not import)


def _probe(module_name: str, names: dict[str, str]) -> None:
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a package that does not import here: its route is unavailable, not this run
        PROBE_ERRORS[module_name] = f"{type(err).__name__}: {err}"
        return
    for attr, name in names.items():
        _wrap(module, attr, name)


class KernelProbe:
    """`with KernelProbe() as probe: ...` then `probe.calls`: the kernel calls made inside the block, by kind."""

    def __enter__(self):
        install_probes()
        self._start = Counter(CALLS)
        self.calls = Counter()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.calls = CALLS - self._start


def describe(calls: Counter) -> str:
    """A one-line account of which kernels ran."""
    parts = []
    if calls["flash_qla_fwd"] or calls["flash_qla_bwd"]:
        parts.append(f"FlashQLA (fwd {calls['flash_qla_fwd']}, bwd {calls['flash_qla_bwd']})")
    if calls["fla_triton_fwd"] or calls["fla_triton_bwd"]:
        bwd, tile = calls["fla_triton_bwd"], calls["tilelang_dqkwg"]
        where = ""
        if bwd:
            where = ", dqkwg on Triton" if not tile else f", dqkwg on TileLang in {tile} of {bwd}"
        parts.append(f"fla Triton (fwd {calls['fla_triton_fwd']}, bwd {bwd}{where})")
    if calls["torch_reference"]:
        parts.append(f"transformers' torch reference ({calls['torch_reference']} calls)")
    if not parts and (calls["gdn_layer_tree"] or calls["gdn_layer_flat"]):
        # transformers' own fallback to its torch reference is not counted: `resolved_kernels` names it
        return f"uncounted kernel: {', '.join(sorted(set(resolved_kernels().values())))}"
    return "; ".join(parts) or "no Gated DeltaNet kernel call seen"


def route_problem(route: str, calls: Counter, backward: bool = True) -> str | None:
    """Why `calls` (a forward, and a backward if `backward`) are not the kernels of `route`, or None."""
    fla_calls = calls["fla_triton_fwd"] + calls["fla_triton_bwd"]
    qla_calls = calls["flash_qla_fwd"] + calls["flash_qla_bwd"]
    wanted = {
        "torch": ["torch_reference"],
        "flash_qla": ["flash_qla_fwd"] + (["flash_qla_bwd"] if backward else []),
        "fla_tilelang": ["fla_triton_fwd"] + (["fla_triton_bwd", "tilelang_dqkwg"] if backward else []),
        "fla_triton": ["fla_triton_fwd"] + (["fla_triton_bwd"] if backward else []),
    }[route]
    missing = [name for name in wanted if not calls[name]]
    foreign = {
        "torch": fla_calls + qla_calls,
        "flash_qla": fla_calls + calls["torch_reference"],
        "fla_tilelang": qla_calls + calls["torch_reference"] + abs(calls["tilelang_dqkwg"] - calls["fla_triton_bwd"]),
        "fla_triton": qla_calls + calls["torch_reference"] + calls["tilelang_dqkwg"],
    }[route]
    if missing or foreign:
        return f"route {route} expected {wanted}, saw: {describe(calls)}"
    return None


def _fla_guard() -> bool:
    """Whether this fla refuses the gated dqkwg backward here (fla#640: Hopper, 3.4 <= Triton < 3.7.1)."""
    try:
        chunk_o = importlib.import_module("fla.ops.common.chunk_o")
    except ImportError:
        return False
    needed = ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")
    if not all(hasattr(chunk_o, name) for name in needed):
        return False  # fla 0.4: no guard
    return chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def _import_error(name: str) -> str | None:
    try:
        importlib.import_module(name)
    except Exception as err:  # what transformers' fallback swallowed
        return f"{type(err).__name__}: {err}"
    return None


def unavailable(route: str, head_dim: int | None = None, dtype: torch.dtype | None = None, lift_guard=False):
    """Why `route` cannot run a Gated DeltaNet call of `head_dim` (K = V) in `dtype` here, or None.

    `lift_guard` (fla_triton): True lifts fla's Hopper refusal where the dqkwg tile is BK = 128 (K >= 128) only;
    "always" lifts it at any K, to show what the miscompiled BK = 64 tile does (`gdn_kernel_check.py`)."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    if route == "torch":
        return None
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed"
    if (error := _import_error("fla")) is not None:
        return f"flash-linear-attention does not import: {error}"
    for module in _gdn_modules():
        if not _is_fla(module):
            return f"{module.__name__} resolved the torch reference although fla imports"
    if route == "flash_qla":
        if importlib.util.find_spec("flash_qla") is None:
            return "flash-qla is not installed"
        if not _has_module("fla.ops.gated_delta_rule.backends.flash_qla"):
            return "this flash-linear-attention has no FlashQLA backend"
        if (error := _import_error("flash_qla")) is not None:
            return f"flash-qla does not import: {error}"
        if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
            return f"FlashQLA takes bf16 / fp16 only (fla runs {dtype} itself)"
        if head_dim is not None and head_dim != 128:
            return f"FlashQLA needs K = V = 128 (got {head_dim}; fla runs it itself)"
        if torch.cuda.get_device_capability() not in ((9, 0), (10, 0), (10, 3)):
            return f"FlashQLA's backward needs SM90 / SM100 (got {torch.cuda.get_device_capability()})"
    if route == "fla_tilelang":
        if importlib.util.find_spec("tilelang") is None:
            return "tilelang is not installed"
        if not _has_module("fla.ops.common.backends.tilelang"):
            return "this flash-linear-attention has no TileLang backend"
        if (error := _import_error("tilelang")) is not None:
            return f"tilelang does not import: {error}"
        from fla.utils import has_usable_nvcc

        if not has_usable_nvcc():
            return "no nvcc for TileLang's JIT (set CUDA_HOME)"
    lifted = lift_guard == "always" or (lift_guard and head_dim is not None and head_dim >= 128)
    if route == "fla_triton" and _fla_guard() and not lifted:
        return (
            "flash-linear-attention refuses its gated dqkwg backward on Hopper with 3.4 <= Triton < 3.7.1 "
            f"(fla#640: the BK = 64 tile miscompiles; K = {head_dim} tiles BK = {min(head_dim or 64, 128)})"
        )
    return None


def _implementation(dispatch):
    """The function transformers resolved behind the tree's dispatch: fla's, or the torch reference."""
    original = dispatch.tree_original  # the tree's dispatch (and the layer counter around it) keep it
    found = recurrent._hub_wrapper_state(original).get("implementation")
    return found if found is not None else inspect.unwrap(original)


def _is_fla(module) -> bool:
    return _implementation(getattr(module, _GDN_FUNCTION)).__module__.startswith("fla.")


def resolved_kernels() -> dict[str, str]:
    """`{modeling module: the function its Gated DeltaNet layers call}` for the imported modules."""
    out = {}
    for module in _gdn_modules():
        fn = _implementation(getattr(module, _GDN_FUNCTION))
        out[module.__name__] = f"{fn.__module__}.{fn.__qualname__}"
    return out


@contextlib.contextmanager
def select(route: str, lift_guard: bool = False):
    """Run the block on `route`'s kernels (see the module docstring); restores everything on exit.

    `lift_guard` (fla_triton only): let fla 0.6's Triton dqkwg backward run on Hopper with Triton < 3.7.1; the caller
    keeps it to K >= 128 (BK = 128) unless it means to show the BK = 64 miscompile."""
    if route not in ROUTES:
        raise ValueError(f"unknown Gated DeltaNet route {route!r}; choose one of {ROUTES}")
    env = {
        "torch": {},
        "flash_qla": {"FLA_FLASH_QLA": "1"},
        "fla_tilelang": {"FLA_FLASH_QLA": "0", "FLA_TILELANG": "1"},
        "fla_triton": {"FLA_FLASH_QLA": "0", "FLA_TILELANG": "0"},
    }[route]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env))
        if route == "torch":
            for module in _gdn_modules():
                torch_fn = _torch_reference(module)
                stack.enter_context(
                    mock.patch.object(
                        module, _GDN_FUNCTION, transformers_compat._tree_dispatch(torch_fn, recurrent.tree_delta_rule)
                    )
                )
        if route == "fla_triton" and lift_guard and _fla_guard():
            stack.enter_context(mock.patch("fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1", True))
        yield


def _torch_reference(module):
    """transformers' torch reference of `module`, counted as `torch_reference` calls."""
    reference = inspect.unwrap(getattr(module, _GDN_FUNCTION))
    if reference.__module__ != module.__name__:
        raise RuntimeError(f"{module.__name__}.{_GDN_FUNCTION} does not unwrap to its torch reference: {reference}")
    return _counting("torch_reference", reference)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


_FLA_LOG = _Collect()


def fla_log() -> list[str]:
    """fla's own backend decisions so far (`[FLA Backend] op.fn -> backend`, `... rejected: why`), each logged once
    per process by fla."""
    logger = logging.getLogger("fla")
    if _FLA_LOG not in logger.handlers:
        logger.addHandler(_FLA_LOG)
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    return [m for m in _FLA_LOG.messages if "FLA Backend" in m]


def provenance_versions() -> dict[str, str | None]:
    """`versions()` less what `harness.provenance` records itself (torch, transformers, the GPU): its extras."""
    return {k: v for k, v in versions().items() if k not in ("torch", "transformers", "gpu")}


def versions() -> dict[str, str | None]:
    """Versions of everything that decides which kernel runs."""
    out = {}
    for name in ("torch", "transformers", "triton", "flash-linear-attention", "fla-core", "flash-qla", "tilelang",
                 "apache-tvm-ffi", "causal-conv1d"):  # fmt: skip
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["cuda"] = torch.version.cuda
    out["nvcc"] = shutil.which("nvcc")
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out
