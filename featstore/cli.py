"""The featstore command: compute, inspect, verify and tidy a store from a shell.

Built on the public API only. Every subcommand takes ``--storage-option KEY=VALUE`` (repeatable;
prefer the standard credential chain for secrets) and ``--json`` (one JSON document on stdout).
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from . import (ComputeFailed, ComputeOptions, ConditionalWritesUnsupported, CorruptChunk, FeatstoreError,
               IncompatibleFormat, InvalidInput, StoreConflict, StoreUnavailable, VersionNotFound, open_store)


class Exit(enum.IntEnum):
    """The exit codes of ``featstore`` (documented in ``featstore --help``)."""

    OK = 0
    DAMAGED = 1            # verify found damaged shards (or a read hit a corrupt chunk)
    USAGE = 2              # bad arguments or bad input (argparse, InvalidInput)
    UNAVAILABLE = 3        # the store cannot be reached, no valid credentials, or it ignores conditional creates
    NOT_FOUND = 4          # no such feature set, version or tag
    COMPUTE_FAILED = 5     # Model A or the dataset raised in a task; finished shards are kept
    CONFLICT = 6           # another writer got there first
    INCOMPATIBLE = 7       # metadata malformed or written by a newer featstore
    INTERRUPTED = 130      # Ctrl-C


_EXIT_OF: tuple[tuple[type[BaseException], Exit], ...] = (
    (CorruptChunk, Exit.DAMAGED), (StoreUnavailable, Exit.UNAVAILABLE),
    (ConditionalWritesUnsupported, Exit.UNAVAILABLE), (VersionNotFound, Exit.NOT_FOUND),
    (ComputeFailed, Exit.COMPUTE_FAILED), (StoreConflict, Exit.CONFLICT), (IncompatibleFormat, Exit.INCOMPATIBLE),
    (InvalidInput, Exit.USAGE),
)

EXIT_CODES_HELP = """exit codes:
  0    ok
  1    verify found damaged data (or a read hit a corrupt chunk)
  2    usage: bad arguments or bad input (import path, outputs, name, ...)
  3    the store cannot be reached, or there are no valid credentials for it, or its S3
       server ignores conditional creates (see the README section 'S3-compatible servers')
  4    no such feature set, version or tag
  5    compute failed: Model A or the dataset raised in a task (finished shards are kept;
       rerun the same command to resume)
  6    conflict: another writer committed first
  7    incompatible: stored metadata is malformed or from a newer featstore
  130  interrupted"""


def exit_code(exc: BaseException) -> Exit:
    """The exit code for an error featstore raised."""
    for cls, code in _EXIT_OF:
        if isinstance(exc, cls):
            return code
    return Exit.COMPUTE_FAILED if isinstance(exc, FeatstoreError) else Exit.USAGE


def parse_value(text: str) -> Any:
    """A ``--storage-option`` value: JSON when it parses (numbers, true/false, null, lists),
    else the string as given.

    >>> parse_value("8"), parse_value("true"), parse_value("http://127.0.0.1:9000")
    (8, True, 'http://127.0.0.1:9000')
    """
    try:
        return json.loads(text)
    except ValueError:
        return text


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InvalidInput(f"{what} {item!r} is not KEY=VALUE.")
        out[key.strip()] = value.strip()
    return out


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--storage-option`` pairs as fsspec ``storage_options``."""
    return {k: parse_value(v) for k, v in _pairs(args.storage_option, "--storage-option").items()}


def parse_outputs(text: str) -> dict[str, str]:
    """``features=float16,logits=float32`` -> ``{"features": "float16", "logits": "float32"}``."""
    return _pairs([p for p in text.split(",") if p.strip()], "--outputs entry") or {"features": "float32"}


def _store(args: argparse.Namespace) -> Any:
    return open_store(args.url, storage_options=storage_options(args))


# ---------------------------------------------------------------------------------------------
# Subcommands: each returns (exit code, JSON-able result, human text).
# ---------------------------------------------------------------------------------------------
Result = tuple[int, Any, str]


def _version_json(v: Any, tags: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": v.name, "version": v.id, "samples": len(v), "created_at": v.manifest.created_at,
            "tags": sorted(t for t, vid in (tags or {}).items() if vid == v.id)}


def cmd_compute(args: argparse.Namespace) -> Result:
    """Compute Model A's outputs over a dataset on Dask and commit them as a version."""
    from .imports import Factory, FactoryDataset

    store = _store(args)
    options = ComputeOptions(progress=not args.no_progress and not args.json, model_id=args.model_id,
                             dataset_id=args.dataset_id)
    v = store.compute(args.name, model=Factory(args.model), dataset=FactoryDataset(args.dataset),
                      input_key=_key(args.input_key), keep=[_key(k) for k in args.keep],
                      outputs=parse_outputs(args.outputs), batch_size=args.batch_size,
                      samples_per_shard=args.samples_per_shard, client=args.scheduler, options=options)
    m = v.manifest
    out = {**_version_json(v), "shards": m.layout.n_shards, "arrays": sorted(m.arrays), "timings": m.timings}
    return Exit.OK, out, f"committed {v.name}@{v.id}: {len(v)} samples, {m.layout.n_shards} shards"


def _key(text: str | None) -> Any:
    """A field name, or an int index for tuple items (``--input-key 0``)."""
    return int(text) if text is not None and text.lstrip("-").isdigit() else text


def cmd_list(args: argparse.Namespace) -> Result:
    """List feature sets and their committed versions (with tags)."""
    store = _store(args)
    rows = []
    for name in [args.name] if args.name else store.names():
        tags = store.tags(name)
        rows.extend(_version_json(v, tags) for v in store.versions(name))
    text = "\n".join(f"{r['name']}@{r['version']}  {r['samples']:>10} samples  {r['created_at']}  "
                     f"{','.join(r['tags'])}" for r in rows)
    return Exit.OK, rows, text or "(no committed versions)"


def cmd_info(args: argparse.Namespace) -> Result:
    """Print a version's manifest (layout, arrays, codecs, statistics, timings)."""
    m = _store(args).open(args.ref).manifest.to_json()
    return Exit.OK, m, json.dumps(m, indent=2, sort_keys=True)


def cmd_verify(args: argparse.Namespace) -> Result:
    """Read every shard of a version and check it against its compute-time digest."""
    v = _store(args).open(args.ref)
    problems = v.verify(progress=not args.json)
    summary = (f"{v.name}@{v.id}: {v.manifest.layout.n_shards} shards x {len(v.manifest.arrays)} arrays checked, "
               f"{len(problems)} bad")
    return (Exit.DAMAGED if problems else Exit.OK, {"name": v.name, "version": v.id, "ok": not problems,
            "problems": problems}, "\n".join([*problems, summary]))


def cmd_tag(args: argparse.Namespace) -> Result:
    """Point a tag (NAME@TAG) at a version."""
    store = _store(args)
    v = store.open(args.ref)
    store.tag(v, args.tag)
    return Exit.OK, {"name": v.name, "tag": args.tag, "version": v.id}, f"{v.name}@{args.tag} -> {v.id}"


def cmd_delete(args: argparse.Namespace) -> Result:
    """Delete a committed version (its tags, manifest and data)."""
    store = _store(args)
    v = store.open(args.ref)
    store.delete(v)
    return Exit.OK, {"name": v.name, "version": v.id, "deleted": True}, f"deleted {v.name}@{v.id}"


def cmd_gc(args: argparse.Namespace) -> Result:
    """Delete what no committed version needs: never-committed version folders older than
    --older-than, and temporary objects left by killed writers."""
    deleted = _store(args).gc(older_than=args.older_than, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    return (Exit.OK, {"deleted": deleted, "dry_run": args.dry_run},
            "\n".join([*deleted, f"{verb} {len(deleted)} objects"]))


def cmd_demo(args: argparse.Namespace) -> Result:
    """Compute a small CNN's outputs with Dask into a store, train an MLP from it, and compare
    with running the CNN every step; prints the dashboard page's URL while it computes."""
    from .demo import run_demo

    res = run_demo(args.root, n=args.n, epochs=args.epochs, workers=args.workers,
                   storage_options=storage_options(args))
    return Exit.OK, res, ""


# ---------------------------------------------------------------------------------------------
# The parser.
# ---------------------------------------------------------------------------------------------
REF_HELP = "NAME (its newest version), NAME@TAG or NAME@VERSION"


def _describe(text: str) -> str:
    return textwrap.fill(" ".join(text.split()), 88)


def _first_line(fn: Callable) -> str:
    """A subcommand's one-line help: its docstring's first sentence."""
    return " ".join((fn.__doc__ or "").split()).split(". ")[0].rstrip(".")


def _common(p: argparse.ArgumentParser, url: bool = True) -> None:
    if url:
        p.add_argument("url", metavar="URL", help="the store: a folder, or s3://bucket/prefix (any fsspec URL)")
    p.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="an fsspec storage option, repeatable (e.g. endpoint_url=http://127.0.0.1:9000); values "
                        "are JSON when they parse. Prefer the credential chain (environment, profile) for secrets")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text")


def _add_compute(sub: Any) -> None:
    c = sub.add_parser("compute", help=_first_line(cmd_compute), description=_describe(cmd_compute.__doc__ + (
        " Model A and the dataset are named by import path (pkg.module:factory) and built on each "
        "Dask worker; rerunning the same command resumes or returns the committed version. The "
        "Dask dashboard's featstore page shows the progress (where the scheduler has featstore's "
        "preload: always on the embedded cluster; `dask scheduler --preload featstore.dashboard`).")),
        epilog="example:\n  featstore compute s3://bucket/feats cnn-a/train --model mypkg.models:teacher \\\n"
               "      --dataset mypkg.data:train_set --outputs features=float16,logits=float32 --keep target \\\n"
               "      --scheduler tcp://scheduler:8786\n\n" + EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(c)
    c.add_argument("name", metavar="NAME", help="the feature set, e.g. cnn-a/train")
    c.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY",
                   help="Model A: a zero-argument callable returning an nn.Module (a class works)")
    c.add_argument("--dataset", required=True, metavar="PKG.MODULE:FACTORY",
                   help="a zero-argument callable returning a map-style dataset")
    c.add_argument("--outputs", default="features=float32", metavar="NAME=CODEC,...",
                   help="Model A's outputs and how to store each: float32, float16 or bfloat16 "
                        "(default features=float32)")
    c.add_argument("--keep", action="append", default=[], metavar="FIELD",
                   help="a per-sample field of the dataset's items to store too (e.g. target), repeatable")
    c.add_argument("--input-key", default="input", metavar="KEY",
                   help="the field of each item that goes into Model A (an integer for tuple items; default input)")
    c.add_argument("--batch-size", type=int, default=256, metavar="N", help="samples per forward (default 256)")
    c.add_argument("--samples-per-shard", type=int, default=None, metavar="N",
                   help="rows per stored shard (default: about 16 MiB shards)")
    c.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="a Dask scheduler (tcp://host:8786); default: an embedded local cluster")
    c.add_argument("--model-id", default=None, metavar="ID",
                   help="names Model A's exact weights, so the factory is not built here to fingerprint it")
    c.add_argument("--dataset-id", default=None, metavar="ID",
                   help="names the dataset's exact contents instead of a sampled digest")
    c.add_argument("--no-progress", action="store_true", help="no terminal progress bar")
    c.set_defaults(fn=cmd_compute)


def _add_simple(sub: Any, name: str, fn: Callable[[argparse.Namespace], Result],
                extra: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(name, help=_first_line(fn), description=_describe(fn.__doc__), epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    extra(p)
    p.set_defaults(fn=fn)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    p = argparse.ArgumentParser(prog="featstore", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_compute(sub)
    _add_simple(sub, "list", cmd_list, lambda s: s.add_argument(
        "name", nargs="?", metavar="NAME", help="only this feature set (default: all)"))
    _add_simple(sub, "info", cmd_info, lambda s: s.add_argument("ref", metavar="REF", help=REF_HELP))
    _add_simple(sub, "verify", cmd_verify, lambda s: s.add_argument("ref", metavar="REF", help=REF_HELP))

    def tag_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("ref", metavar="REF", help=REF_HELP)
        s.add_argument("tag", metavar="TAG", help="the tag to set, e.g. best")
    _add_simple(sub, "tag", cmd_tag, tag_args)
    _add_simple(sub, "delete", cmd_delete, lambda s: s.add_argument("ref", metavar="REF", help=REF_HELP))

    def gc_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                       help="only folders untouched this long (default 3600: a younger one may be a running compute)")
        s.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    _add_simple(sub, "gc", cmd_gc, gc_args)

    def demo_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("-n", type=int, default=20000, metavar="N", help="samples (default 20000)")
        s.add_argument("--epochs", type=int, default=3, metavar="E", help="epochs of Model B (default 3)")
        s.add_argument("--workers", type=int, default=0, metavar="W", help="DataLoader workers (default 0)")
    d = sub.add_parser("demo", help=_first_line(cmd_demo), description=_describe(cmd_demo.__doc__),
                       epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--root", default="./featstore-demo", metavar="URL",
                   help="the store to compute into (default ./featstore-demo)")
    _common(d, url=False)
    demo_args(d)
    d.set_defaults(fn=cmd_demo)
    return p


def _emit(args: argparse.Namespace, code: int, result: Any, text: str) -> int:
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    elif text:
        print(text)
    return int(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``featstore`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return _emit(args, *args.fn(args))
    except FeatstoreError as exc:
        code = exit_code(exc)
        if args.json:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc), "exit_code": int(code)}))
        print(f"featstore: error: {exc}", file=sys.stderr)
        return int(code)
    except KeyboardInterrupt:
        print("featstore: interrupted", file=sys.stderr)
        return int(Exit.INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
