"""Offline shims + trainer substitution for running TRL's tests/test_grpo_trainer.py.

Loaded by pytest before tests/conftest.py and before the test module is imported.

TRL_PEER_TRAINER=trl   (default) run TRL's own GRPOTrainer / GRPOConfig (baseline)
TRL_PEER_TRAINER=tree  `from trl import GRPOConfig, GRPOTrainer` in the test module resolves to
                       hf_tree_attn.trainer.TreeGRPOConfig / TreeGRPOTrainer (the test bodies are untouched)
TRL_PEER_EVENTS=path   append one JSON line per warning (warnings module and logging >= WARNING) per test
"""

import json
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# jmespath (the tool-calling tests need it) is installed with --target into extra_site, outside the venv.
sys.path.insert(0, str(HERE / "extra_site"))
# Model ids like "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5" resolve as local folders relative to the cwd.
os.chdir(HERE)

# ---- trl 1.16.0 vs the newest test file in the mirror: testing_utils imports a helper this trl lacks -------------
import trl.import_utils as _iu  # noqa: E402

if not hasattr(_iu, "is_joblib_available"):
    import importlib.util

    _iu.is_joblib_available = lambda: importlib.util.find_spec("joblib") is not None

# ---- datasets.load_dataset: the zen datasets from local disk ---------------------------------------------------
import datasets  # noqa: E402

_real_load_dataset = datasets.load_dataset
_ZEN = HERE / "hub" / "datasets"


def _offline_load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    if isinstance(path, str) and path.startswith("trl-internal-testing/"):
        repo = path.split("/", 1)[1]
        folder = _ZEN / repo / (name or "default")
        if not folder.exists():
            raise FileNotFoundError(f"[offline shim] no local stand-in for {path!r} config {name!r}")
        dd = datasets.load_from_disk(str(folder))
        if streaming:
            dd = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in dd.items()})
        return dd[split] if split is not None else dd
    return _real_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)


datasets.load_dataset = _offline_load_dataset

# ---- trainer substitution -------------------------------------------------------------------------------------
TRAINER = os.environ.get("TRL_PEER_TRAINER", "trl")
import trl  # noqa: E402

if TRAINER == "tree":
    sys.path.insert(0, os.environ["PROJECT_DIR"])  # the project checkout under test
    import hf_tree_attn  # noqa: F401,E402  (registers attn_implementation="tree_flex")
    from hf_tree_attn.trainer import TreeGRPOConfig, TreeGRPOTrainer  # noqa: E402

    trl.GRPOTrainer = TreeGRPOTrainer
    trl.GRPOConfig = TreeGRPOConfig

    # Instrumentation only (behaviour unchanged): count tree forwards vs TRL flat fallbacks per test.
    import functools

    _COUNTS = {"tree_forwards": 0, "tree_chunks": 0, "flat_fallback_chunks": 0}
    # (skipped where these private methods no longer exist)
    _orig_tree_logps = getattr(TreeGRPOTrainer, "_tree_logps", None)
    _orig_packed_chunk = getattr(TreeGRPOTrainer, "_packed_chunk", None)

    @functools.wraps(_orig_tree_logps or (lambda *a, **k: None))
    def _counted_tree_logps(self, model, packed, *a, **k):
        _COUNTS["tree_chunks"] += 1
        _COUNTS["tree_forwards"] += len(packed)
        return _orig_tree_logps(self, model, packed, *a, **k)

    @functools.wraps(_orig_packed_chunk or (lambda *a, **k: None))
    def _counted_packed_chunk(self, *a, **k):
        out = _orig_packed_chunk(self, *a, **k)
        if out is None:
            _COUNTS["flat_fallback_chunks"] += 1
        return out

    from trl.trainer.grpo_trainer import GRPOTrainer as _TRLGRPOTrainer

    _COUNTS["trl_flat_calls"] = 0
    _orig_flat = _TRLGRPOTrainer._get_per_token_logps_and_entropies

    @functools.wraps(_orig_flat)
    def _counted_flat(self, *a, **k):
        _COUNTS["trl_flat_calls"] += 1
        return _orig_flat(self, *a, **k)

    _TRLGRPOTrainer._get_per_token_logps_and_entropies = _counted_flat
    if _orig_tree_logps is not None and _orig_packed_chunk is not None:
        TreeGRPOTrainer._tree_logps = _counted_tree_logps
        TreeGRPOTrainer._packed_chunk = _counted_packed_chunk
elif TRAINER != "trl":
    raise ValueError(f"TRL_PEER_TRAINER={TRAINER!r}: use 'trl' or 'tree'")


def pytest_report_header(config):
    return f"trl_peer: trainer={TRAINER} GRPOTrainer={trl.GRPOTrainer.__module__}.{trl.GRPOTrainer.__name__}"


def pytest_collection_modifyitems(session, config, items):
    # Prove the substitution reached the test module's namespace.
    for item in items:
        mod = getattr(item, "module", None)
        if mod is not None and hasattr(mod, "GRPOTrainer"):
            assert mod.GRPOTrainer is trl.GRPOTrainer, (mod.GRPOTrainer, trl.GRPOTrainer)
            assert mod.GRPOConfig is trl.GRPOConfig
            break


# ---- warning/event recording ----------------------------------------------------------------------------------
_EVENTS = os.environ.get("TRL_PEER_EVENTS")
_current = {"nodeid": None}


def _emit(rec):
    if not _EVENTS:
        return
    rec["test"] = _current["nodeid"]
    with open(_EVENTS, "a") as f:
        f.write(json.dumps(rec) + "\n")


class _Recorder(logging.Handler):
    def emit(self, record):
        # Attached to the root and to library loggers: a record that propagates reaches it twice, recorded once.
        if getattr(record, "_trl_peer_recorded", False):
            return
        record._trl_peer_recorded = True
        if record.levelno >= logging.WARNING:
            try:
                msg = record.getMessage()
            except Exception:
                msg = str(record.msg)
            _emit(
                {
                    "kind": "logging",
                    "level": record.levelname,
                    "logger": record.name,
                    "message": msg[:500],
                    "where": f"{record.pathname}:{record.lineno}",
                }
            )


_handler = _Recorder()
logging.getLogger().addHandler(_handler)


def pytest_runtest_teardown(item, nextitem):
    if TRAINER == "tree":
        _emit({"kind": "tree_counts", **_COUNTS})
        for k in _COUNTS:
            _COUNTS[k] = 0


def pytest_runtest_setup(item):
    _current["nodeid"] = item.nodeid
    # transformers/trl loggers often don't propagate to root; attach to them too.
    for name in ("transformers", "trl", "trainers", "hf_tree_attn", "accelerate", "peft"):
        lg = logging.getLogger(name)
        if _handler not in lg.handlers:
            lg.addHandler(_handler)


def pytest_warning_recorded(warning_message, when, nodeid, location):
    _emit(
        {
            "kind": "warning",
            "when": when,
            "category": warning_message.category.__name__,
            "message": str(warning_message.message)[:500],
            "where": f"{warning_message.filename}:{warning_message.lineno}",
            "nodeid": nodeid,
        }
    )


# ---- per-test results (survive a chunk being killed by `timeout`) ------------------------------------------------
_RESULTS = os.environ.get("TRL_PEER_RESULTS")


def pytest_runtest_logreport(report):
    if not _RESULTS:
        return
    if (
        report.when == "call"
        or (report.when == "setup" and report.outcome != "passed")
        or (report.when == "teardown" and report.outcome == "failed")
    ):
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfail" if report.outcome == "skipped" else "xpass"
        rec = {"test": report.nodeid, "when": report.when, "outcome": outcome, "duration": round(report.duration, 2)}
        if report.outcome == "failed":
            rec["longrepr"] = str(report.longrepr)[-6000:]
        elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
            rec["reason"] = report.longrepr[2]
        with open(_RESULTS, "a") as f:
            f.write(json.dumps(rec) + "\n")
