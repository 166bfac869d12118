"""Prune a copy of a Triton cache to what a cache hit loads, so it can travel to a fresh GPU machine.

    python bench/tcache_prune.py CACHE_COPY

A hit reads a kernel's group file (`__grp__<name>.json`, which names its files by their absolute path in
the cache it was made in) and every file the group lists; the launch needs only the metadata json and the
cubin. Each CUDA kernel's group is rewritten to list only those two, and its other files (IRs, PTX, source)
are deleted from the copy. The copy must be unpacked at the original cache's path (the paths in the groups)
for the hits to happen: `.gl/s85.sh` keeps the cache at /tmp/k3tc for that reason. Groups without a cubin
(launcher stubs) stay whole.
"""

from __future__ import annotations

import json
import os
import sys


def prune(root: str) -> tuple[int, int]:
    """(kernel groups rewritten, files deleted) in the cache copy at `root`."""
    kept = dropped = 0
    for d in sorted(os.listdir(root)):
        dd = os.path.join(root, d)
        if not os.path.isdir(dd):
            continue
        for f in sorted(os.listdir(dd)):
            if not f.startswith("__grp__"):
                continue
            path = os.path.join(dd, f)
            with open(path) as fh:
                group = json.load(fh)
            children = group.get("child_paths", {})
            keep = {k: v for k, v in children.items() if k.endswith((".json", ".cubin"))}
            if not any(k.endswith(".cubin") for k in keep):
                continue
            for k, v in children.items():  # the copy's file of that name (the group names the original's)
                here = os.path.join(dd, os.path.basename(v))
                if k not in keep and os.path.exists(here):
                    os.remove(here)
                    dropped += 1
            group["child_paths"] = keep
            with open(path, "w") as fh:
                json.dump(group, fh)
            kept += 1
    return kept, dropped


if __name__ == "__main__":
    groups, files = prune(sys.argv[1])
    print(f"pruned {groups} kernel groups, {files} files dropped")
