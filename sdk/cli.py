"""The `dayzero` command."""

from __future__ import annotations

import argparse
import sys


def _bench(args: argparse.Namespace) -> int:
    if args.part == "scheduler":
        from dayzero.sdk.bench import scheduler

        sizes = tuple(int(x) for x in args.sizes.split(","))
        scheduler.run(sizes, args.steps)
        return 0
    print(f"dayzero bench: unknown part {args.part!r}; known: scheduler", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dayzero",
        description="dayzero: Day-0 model enablement from a declarative spec.",
    )
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    b = sub.add_parser("bench", help="measure a part of dayzero (prints a table and a summary line)")
    b.add_argument("part", choices=["scheduler"], help="scheduler: the control plane alone vs TokenSpeed")
    b.add_argument("--sizes", default="32,256,1024", help="live request counts (comma separated)")
    b.add_argument("--steps", type=int, default=1000, help="timed decode steps per size")
    b.set_defaults(fn=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
