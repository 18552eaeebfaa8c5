"""``python -m imagebuild build [NAME...] | refs [NAME...]`` (PYTHONPATH=dev, after dev/env.sh)."""

from __future__ import annotations

import argparse
import sys
import time

from imagebuild import build
from imagebuild.errors import ImageBuildError
from imagebuild.spec import IMAGE_NAMES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m imagebuild", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help_ in (("build", "build the images this machine lacks (default: all)"),
                        ("refs", "print name=ref for this checkout; builds nothing")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("names", nargs="*", metavar="NAME", help=f"any of: {', '.join(IMAGE_NAMES)}")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        if args.command == "refs":
            result = build.refs(args.names)
        else:
            result = build.ensure_images(args.names)
    except (ImageBuildError, ValueError) as exc:
        print(f"imagebuild: {exc}", file=sys.stderr)
        return 1
    for name, ref in result.items():
        print(f"{name}={ref}")
    if args.command == "build":
        print(f"[imagebuild] done in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
