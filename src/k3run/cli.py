"""The `k3run` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k3run", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run-default", help="run the main job on the bundled default model")
    args = parser.parse_args(argv)
    if args.cmd == "run-default":
        import torch

        print(f"k3run: torch {torch.__version__}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
