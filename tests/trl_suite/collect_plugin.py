"""pytest plugin: write every collected test id of TRL's test file, with its skip reason, to $LIST_OUT (JSON)."""

import json
import os


def pytest_collection_modifyitems(session, config, items):
    out = []
    for item in items:
        reason = None
        for mark in item.iter_markers():
            if mark.name == "skip":
                reason = mark.kwargs.get("reason") or (mark.args[0] if mark.args else "skip")
                break
            if mark.name == "skipif" and mark.args and bool(mark.args[0]):
                reason = mark.kwargs.get("reason")
                break
        out.append({"id": item.nodeid, "skip": reason})
    with open(os.environ["LIST_OUT"], "w") as f:
        json.dump(out, f, indent=0)
