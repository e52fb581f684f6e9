"""Device gates, declared once: `@pytest.mark.gpu` / `multi_gpu` tests skip without CUDA (CI has none)."""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
