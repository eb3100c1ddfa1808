"""The ``featstore`` command, built on the public API only.

    featstore demo [--root DIR] [-n N] [--epochs E] [--workers W]
    featstore list URL [NAME]
    featstore info URL REF
    featstore verify URL REF
    featstore tag URL REF TAG
    featstore delete URL REF
"""

from __future__ import annotations

import argparse
import json
import sys

from . import FeatstoreError, open_store


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.root, n=args.n, epochs=args.epochs, workers=args.workers)
    return 0


def _list(args: argparse.Namespace) -> int:
    store = open_store(args.url)
    for name in [args.name] if args.name else store.names():
        tags = store.tags(name)
        for v in store.versions(name):
            marks = ",".join(t for t, vid in tags.items() if vid == v.id)
            print(f"{name}@{v.id}  {len(v):>10} samples  {v.manifest.created_at}  {marks}")
    return 0


def _info(args: argparse.Namespace) -> int:
    v = open_store(args.url).open(args.ref)
    print(json.dumps(v.manifest.to_json(), indent=2, sort_keys=True))
    return 0


def _verify(args: argparse.Namespace) -> int:
    v = open_store(args.url).open(args.ref)
    problems = v.verify(progress=True)
    for p in problems:
        print(p)
    print(f"{v.name}@{v.id}: {len(v.manifest.shards)} shards x {len(v.manifest.arrays)} arrays checked, "
          f"{len(problems)} bad")
    return 1 if problems else 0


def _tag(args: argparse.Namespace) -> int:
    store = open_store(args.url)
    store.tag(args.ref, args.tag)
    print(f"{args.tag} -> {store.open(args.ref).id}")
    return 0


def _delete(args: argparse.Namespace) -> int:
    store = open_store(args.url)
    v = store.open(args.ref)
    store.delete(v)
    print(f"deleted {v.name}@{v.id}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    p = argparse.ArgumentParser(prog="featstore", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compute a small CNN's outputs with Dask, train an MLP from the store")
    d.add_argument("--root", default="./featstore-demo", help="store URL (default ./featstore-demo)")
    d.add_argument("-n", type=int, default=20000, help="samples (default 20000)")
    d.add_argument("--epochs", type=int, default=3)
    d.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    d.set_defaults(fn=_demo)
    for name, fn, extra in [("list", _list, ["name?"]), ("info", _info, ["ref"]), ("verify", _verify, ["ref"]),
                            ("tag", _tag, ["ref", "tag"]), ("delete", _delete, ["ref"])]:
        s = sub.add_parser(name, help=(fn.__doc__ or name))
        s.add_argument("url", help="store URL (a folder or s3://bucket/prefix)")
        for a in extra:
            if a.endswith("?"):
                s.add_argument(a[:-1], nargs="?")
            else:
                s.add_argument(a, help="NAME, NAME@TAG or NAME@VERSION" if a == "ref" else None)
        s.set_defaults(fn=fn)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``featstore`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except FeatstoreError as exc:
        print(f"featstore: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
