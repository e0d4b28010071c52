"""``python -m shoal.workers.demo [--cache-dir DIR] [--threads N]``: build the demo model if
needed and print its path."""

from __future__ import annotations

import argparse

from shoal.workers.demo.build import ensure_demo_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.workers.demo", description=__doc__)
    parser.add_argument("--cache-dir", default=None, help="cache root (default ~/.cache/shoal)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for training")
    args = parser.parse_args()
    print(ensure_demo_model(args.cache_dir, num_threads=args.threads))


if __name__ == "__main__":
    main()
