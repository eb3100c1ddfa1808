"""The featstore command: compute, inspect, verify and tidy a store from a shell.

Built on the public API only. Every subcommand takes ``--storage-option KEY=VALUE`` (repeatable;
prefer the standard credential chain for secrets) and ``--json`` (one JSON document on stdout).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import os
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from featstore.compute import ComputeOptions
from featstore.errors import (ClusterUnavailable, ComputeFailed, ConditionalWritesUnsupported, CorruptChunk,
                              DeviceSetupError, DistributedSetupError, FeatstoreError, FeatstoreWarning,
                              IncompatibleFormat, InvalidInput, StoreConflict, StoreFull, StoreNotFound,
                              StoreUnavailable, VersionNotFound)

# The command line imports only what each command needs: `featstore --help`, list, info, tag,
# delete, gc, verify and cache never import torch or Dask (the compute and read sides, and the
# disk cache's reader, are imported inside the commands that use them).

#: Set (to anything but 0) to print the traceback of every error, like ``--debug``.
DEBUG_ENV = "FEATSTORE_DEBUG"


class Exit(enum.IntEnum):
    """The exit codes of ``featstore`` (documented in ``featstore --help`` and the README)."""

    OK = 0
    DAMAGED = 1            # verify found damaged shards (or a read hit a corrupt chunk)
    USAGE = 2              # bad arguments or bad input (argparse, InvalidInput)
    UNAVAILABLE = 3        # the store cannot be reached or used (credentials, permissions, full, no If-None-Match)
    NOT_FOUND = 4          # no such store, feature set, version or tag
    COMPUTE_FAILED = 5     # Model A, its factory or the dataset raised; finished shards are kept
    CONFLICT = 6           # another writer got there first
    INCOMPATIBLE = 7       # metadata malformed or written by a newer featstore
    ENVIRONMENT = 8        # the Dask scheduler cannot be reached, or no usable device (CUDA)
    INTERNAL = 70          # a bug in featstore (EX_SOFTWARE): rerun with --debug and report it
    INTERRUPTED = 130      # Ctrl-C


#: The one map from errors to exit codes, most specific first: every class of featstore's error
#: tree has its row (tests/cli/test_mistakes.py holds it to the tree and to the README's table).
_EXIT_OF: tuple[tuple[type[BaseException], Exit], ...] = (
    (CorruptChunk, Exit.DAMAGED), (StoreFull, Exit.UNAVAILABLE), (StoreUnavailable, Exit.UNAVAILABLE),
    (ConditionalWritesUnsupported, Exit.UNAVAILABLE),
    (StoreNotFound, Exit.NOT_FOUND), (VersionNotFound, Exit.NOT_FOUND), (ComputeFailed, Exit.COMPUTE_FAILED),
    (StoreConflict, Exit.CONFLICT), (IncompatibleFormat, Exit.INCOMPATIBLE), (InvalidInput, Exit.USAGE),
    (ClusterUnavailable, Exit.ENVIRONMENT), (DeviceSetupError, Exit.ENVIRONMENT),
    (DistributedSetupError, Exit.ENVIRONMENT), (KeyboardInterrupt, Exit.INTERRUPTED),
)

EXIT_CODES_HELP = """exit codes:
  0    ok
  1    verify found damaged data (or a read hit a corrupt chunk)
  2    usage: bad arguments or bad input (import path, outputs, name, items, ...)
  3    the store cannot be reached or used: no valid credentials, permission denied, disk full,
       or its S3 server ignores conditional creates (see docs/s3.md, 'S3-compatible servers')
  4    no such store, feature set, version or tag
  5    compute failed: Model A, its factory or the dataset raised (fix it and rerun: finished
       shards are kept)
  6    conflict: another writer committed first
  7    incompatible: stored metadata is malformed or from a newer featstore
  8    environment: the Dask scheduler cannot be reached, Model A asks for a device
       (CUDA) the workers lack, or the reader cannot tell its DDP rank
  70   internal error: a bug in featstore (rerun with --debug and report the traceback)
  130  interrupted"""


def exit_code(exc: BaseException) -> Exit:
    """The exit code for an error (:data:`Exit.INTERNAL` for anything featstore did not expect).

    >>> int(exit_code(VersionNotFound("x"))), int(exit_code(TypeError("x")))
    (4, 70)
    """
    for cls, code in _EXIT_OF:
        if isinstance(exc, cls):
            return code
    return Exit.INTERNAL


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage errors are :class:`InvalidInput` (so ``--json`` prints them as JSON
    and they exit 2 like every other bad input), not a print and ``sys.exit``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise InvalidInput(f"{message} (usage: {self.format_usage().strip().removeprefix('usage: ')}; "
                           f"see `{self.prog} --help`)")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """argparse's, except that an argument the subcommand does not know is reported by that
        subcommand (its usage, `featstore verify --help`), not by the top-level parser."""
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            (self._subcommand_parser(ns) or self).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns

    def _subcommand_parser(self, ns: argparse.Namespace) -> argparse.ArgumentParser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                command = getattr(ns, action.dest, None)
                return action.choices.get(command) if isinstance(command, str) else None
        return None


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


def _store(args: argparse.Namespace, create: bool = False) -> Any:
    """The store the command names; only ``compute`` (and ``demo``) may create one."""
    from featstore.store import open_store  # zarr and fsspec: not for --help

    return open_store(args.url, storage_options=storage_options(args), create=create)


@contextlib.contextmanager
def _store_to_write(args: argparse.Namespace) -> Iterator[Any]:
    """The store ``compute`` or ``advise`` writes to, created when there is none yet; a local
    folder this command created is removed again if it holds no file when the command ends (the
    compute failed before writing: a model path that does not import, an unreachable scheduler;
    or ``advise``, which deletes what it measured). Only empty folders are removed."""
    try:
        store, made = _store(args), False
    except StoreNotFound:
        store, made = _store(args, create=True), True
    try:
        yield store
    finally:
        if made and store.storage.is_local:
            for folder, _, _ in os.walk(store.storage.root, topdown=False):
                with contextlib.suppress(OSError):  # not empty: something was written, and is kept
                    os.rmdir(folder)


@contextlib.contextmanager
def _compute_first(store: Any, ref: str) -> Iterator[None]:
    """A ref to a feature set without any committed version says which command makes one (the
    store's own message names the Python call, ``store.compute``); other misses pass as they are."""
    try:
        yield
    except VersionNotFound as exc:
        name = ref.partition("@")[0]
        try:
            if store.versions(name):
                raise
            sets = store.names()
        except FeatstoreError:
            raise exc from None
        raise VersionNotFound(
            f"feature set {name!r} has no committed version in {store.url}; existing sets: {sets or 'none'}. "
            f"Compute it first: featstore compute {store.url} {name} --model PKG.MODULE:FACTORY --dataset "
            "PKG.MODULE:FACTORY (see `featstore compute --help`).") from exc


def _open(store: Any, ref: str) -> Any:
    """``store.open(ref)``, with the command line's advice for a feature set that has no version."""
    with _compute_first(store, ref):
        return store.open(ref)


# ---------------------------------------------------------------------------------------------
# Subcommands: each returns a Result.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    """What a subcommand did: its exit code, the JSON document ``--json`` prints (anything
    ``json.dumps`` takes, other values as their ``str``) and the text printed without it."""

    code: Exit
    data: object
    text: str


def _version_json(v: Any, tags: dict[str, str] | None = None) -> dict[str, Any]:
    return {"name": v.name, "version": v.id, "samples": len(v), "created_at": v.manifest.created_at,
            "tags": sorted(t for t, vid in (tags or {}).items() if vid == v.id)}


def cmd_compute(args: argparse.Namespace) -> Result:
    """Compute Model A's outputs over a dataset on Dask and commit them as a version."""
    from featstore.cli._import_path import Factory, FactoryDataset

    options = ComputeOptions(progress=not args.no_progress and not args.json, model_id=args.model_id,
                             dataset_id=args.dataset_id, connect_timeout=args.connect_timeout)
    with _store_to_write(args) as store:
        v = store.compute(args.name, model=Factory(args.model), dataset=FactoryDataset(args.dataset),
                          input_key=_key(args.input_key), keep=[_key(k) for k in args.keep],
                          outputs=parse_outputs(args.outputs), batch_size=args.batch_size,
                          samples_per_shard=args.samples_per_shard, client=args.scheduler, options=options)
    m, report = v.manifest, v.report
    out = {**_version_json(v), "shards": m.layout.n_shards, "arrays": sorted(m.arrays), "timings": m.timings,
           "report": None if report is None else report.to_json()}
    done = "committed" if report is None or report.computed else "found"
    return Result(Exit.OK, out, f"{done} {v.name}@{v.id}: {len(v)} samples, {m.layout.n_shards} shards"
                  + ("" if report is None else f"; {report.describe()}"))


def _key(text: str | None) -> Any:
    """A field name, or an int index for tuple items (``--input-key 0``)."""
    return int(text) if text is not None and text.lstrip("-").isdigit() else text


def cmd_list(args: argparse.Namespace) -> Result:
    """List feature sets and their committed versions (with tags); a version whose manifest is
    damaged is listed as such, with the command that removes it."""
    store = _store(args)
    rows, lines = [], []
    for name in [args.name] if args.name else store.names():
        tags = store.tags(name)
        versions, damaged = store.catalog.scan(name)
        for v in versions:
            r = {**_version_json(v, tags), "damaged": None}
            rows.append(r)
            lines.append(f"{r['name']}@{r['version']}  {r['samples']:>10} samples  {r['created_at']}  "
                         f"{','.join(r['tags'])}")
        for vid, exc in sorted(damaged.items()):
            rows.append({"name": name, "version": vid, "samples": None, "created_at": None,
                         "tags": sorted(t for t, target in tags.items() if target == vid), "damaged": str(exc)})
            lines.append(f"{name}@{vid}  DAMAGED: {exc}")
    return Result(Exit.OK, rows, "\n".join(lines) or "(no committed versions)")


def cmd_info(args: argparse.Namespace) -> Result:
    """Print a version's manifest (layout, arrays, codecs, statistics, timings)."""
    m = _open(_store(args), args.ref).manifest.to_json()
    return Result(Exit.OK, m, json.dumps(m, indent=2, sort_keys=True))


def cmd_verify(args: argparse.Namespace) -> Result:
    """Read every shard of a version and check it against its compute-time digest."""
    v = _open(_store(args), args.ref)
    problems = v.verify(progress=not args.json)
    summary = (f"{v.name}@{v.id}: {v.manifest.layout.n_shards} shards x {len(v.manifest.arrays)} arrays checked, "
               f"{len(problems)} bad")
    return Result(Exit.DAMAGED if problems else Exit.OK,
                  {"name": v.name, "version": v.id, "ok": not problems, "problems": problems},
                  "\n".join([*problems, summary]))


def cmd_export(args: argparse.Namespace) -> Result:
    """Copy a version to DEST as a self-contained standard Zarr v3 group, for plain Zarr readers.
    Every shard object is copied byte for byte to its default key, the metadata consolidated, and
    the copy read back against the version's digests: the route for zarr, xarray and TensorStore
    to versions made with extends= or spread over prefixes."""
    v = _open(_store(args), args.ref)
    out = v.export(args.dest, storage_options={k: parse_value(x) for k, x in
                                               _pairs(args.dest_option, "--dest-option").items()} or None,
                   verify=not args.no_verify, progress=not args.json)
    res = {"name": v.name, "version": v.id, "url": out.url, "objects": out.objects, "bytes": out.bytes,
           "shards_checked": out.shards_checked}
    return Result(Exit.OK, res, (f"exported {v.name}@{v.id} to {out.url}: {out.objects} shard objects, "
                                 f"{out.bytes} bytes, {out.shards_checked} shards checked"))


def cmd_tag(args: argparse.Namespace) -> Result:
    """Point a tag (NAME@TAG) at a version."""
    store = _store(args)
    v = _open(store, args.ref)
    store.tag(v, args.tag)
    return Result(Exit.OK, {"name": v.name, "tag": args.tag, "version": v.id}, f"{v.name}@{args.tag} -> {v.id}")


def cmd_delete(args: argparse.Namespace) -> Result:
    """Delete a committed version (its tags, manifest and data)."""
    store = _store(args)
    with _compute_first(store, args.ref):
        name, _, vid = store.delete(args.ref).partition("@")  # a version with a damaged manifest too
    return Result(Exit.OK, {"name": name, "version": vid, "deleted": True}, f"deleted {name}@{vid}")


def cmd_gc(args: argparse.Namespace) -> Result:
    """Delete what no committed version needs: never-committed version folders older than
    --older-than, temporary objects left by killed writers, and with --damaged every version
    whose manifest is damaged."""
    deleted = _store(args).gc(older_than=args.older_than, dry_run=args.dry_run, damaged=args.damaged)
    verb = "would delete" if args.dry_run else "deleted"
    return Result(Exit.OK, {"deleted": deleted, "dry_run": args.dry_run},
                  "\n".join([*deleted, f"{verb} {len(deleted)} objects"]))


def cmd_cache(args: argparse.Namespace) -> Result:
    """List or empty this node's disk cache of remote stores (cache='disk'). 'list' shows each
    cached version, its bytes and whether a live process reads it; 'clear' removes entries
    (--unused: only of versions no live process reads). Safe while readers run: they keep what
    they have mapped and fetch the rest again. Not part of 'gc': gc tidies one store, the cache
    belongs to a node and holds many stores."""
    if args.action == "clear":
        from featstore.read import clear_disk_cache

        freed = clear_disk_cache(args.dir, unused_only=args.unused)
        return Result(Exit.OK, {"cleared_bytes": freed}, f"removed {freed} bytes")
    from featstore.read import list_disk_cache

    rows = [asdict(s) for s in list_disk_cache(args.dir)]
    text = "\n".join(f"{r['version']}  {r['store']}  {r['entries']} objects  {r['bytes']} bytes"
                     f"{'  in use' if r['in_use'] else ''}" for r in rows)
    return Result(Exit.OK, rows, text or "(the disk cache is empty)")


def cmd_demo(args: argparse.Namespace) -> Result:
    """Compute a small CNN's outputs with Dask into a store, train an MLP from it, and compare
    with running the CNN every step; prints the dashboard page's URL while it computes."""
    from featstore.demo import run_demo

    res = run_demo(args.root, n=args.n, epochs=args.epochs, workers=args.workers,
                   storage_options=storage_options(args))
    return Result(Exit.OK, res, "")


# ---------------------------------------------------------------------------------------------
# The parser.
# ---------------------------------------------------------------------------------------------
REF_HELP = "NAME (its newest version), NAME@TAG or NAME@VERSION"


def _describe(text: str | None) -> str:
    """A docstring as one paragraph of the help's width (no docstring: no description)."""
    return textwrap.fill(" ".join((text or "").split()), 88)


def _first_line(fn: Callable[..., object]) -> str:
    """A subcommand's one-line help: its docstring's first sentence."""
    return " ".join((fn.__doc__ or "").split()).split(". ")[0].rstrip(".")


def _common(p: argparse.ArgumentParser, url: bool = True) -> None:
    if url:
        p.add_argument("url", metavar="URL", help="the store: a folder, or s3://bucket/prefix (any fsspec URL)")
    p.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="an fsspec storage option, repeatable (e.g. endpoint_url=http://127.0.0.1:9000); values "
                        "are JSON when they parse. Prefer the credential chain (environment, profile) for secrets")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text "
                   "(errors too: {\"error\", \"message\", \"exit_code\"})")
    p.add_argument("--debug", action="store_true", help=f"print the traceback of an error (or set {DEBUG_ENV}=1)")


def _add_compute(sub: Any) -> None:
    c = sub.add_parser("compute", help=_first_line(cmd_compute), description=_describe((cmd_compute.__doc__ or "") + (
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
                   help="Model A's outputs and how to store each: float32, float16, bfloat16, int8, or sparse soft "
                        "labels topk:K, topp:P:MIN_K, sample:S (an unknown codec's error lists every form; "
                        "default features=float32)")
    c.add_argument("--keep", action="append", default=[], metavar="FIELD",
                   help="a per-sample field of the dataset's items to store too (e.g. target), repeatable")
    c.add_argument("--input-key", default="input", metavar="KEY",
                   help="the field of each item that goes into Model A (an integer for tuple items; default input)")
    c.add_argument("--batch-size", type=int, default=256, metavar="N", help="samples per forward (default 256)")
    c.add_argument("--samples-per-shard", type=int, default=None, metavar="N",
                   help="rows per stored shard (default: about 16 MiB shards)")
    c.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="a Dask scheduler (tcp://host:8786); default: an embedded local cluster")
    c.add_argument("--connect-timeout", type=float, default=ComputeOptions.connect_timeout, metavar="SECONDS",
                   help=f"how long to wait for --scheduler to answer (default {ComputeOptions.connect_timeout:g})")
    c.add_argument("--model-id", default=None, metavar="ID",
                   help="names Model A's exact weights, so the factory is not built here to fingerprint it")
    c.add_argument("--dataset-id", default=None, metavar="ID",
                   help="names the dataset's exact contents instead of a sampled digest")
    c.add_argument("--no-progress", action="store_true", help="no terminal progress bar")
    c.set_defaults(fn=cmd_compute)


def cmd_advise(args: argparse.Namespace) -> Result:
    """Measure Model A, the store and (optionally) Model B here, and say which mode pays: online,
    compute-then-read or fill, with each one's predicted time for the epochs, views and students."""
    from featstore.cli._import_path import Factory, FactoryDataset, resolve
    from featstore.online import Teacher, Workload, advise

    dataset = FactoryDataset(args.dataset)
    teacher = Teacher(model=Factory(args.model), dataset=dataset, input_key=_key(args.input_key),
                      keep=[_key(k) for k in args.keep], outputs=parse_outputs(args.outputs), device=args.device,
                      batch_size=args.batch_size)
    student = resolve(args.student)() if args.student else None
    work = Workload(args.samples_total or len(dataset), args.epochs, args.views, args.students)
    with _store_to_write(args) as store:
        advice = advise(store, teacher, work, samples=args.samples, batch_size=args.read_batch_size,
                        student=student)
    return Result(Exit.OK, advice.to_json(), f"{advice.table()}\n\n{advice.reason}")


def _add_advise(sub: Any) -> None:
    a = sub.add_parser("advise", help=_first_line(cmd_advise), description=_describe(cmd_advise.__doc__),
                       epilog="example:\n  featstore advise ./feats --model mypkg.models:teacher --dataset "
                              "mypkg.data:train_set \\\n      --outputs features=float16 --epochs 10 --views 1\n\n"
                              + EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(a)
    a.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY", help="Model A's factory")
    a.add_argument("--dataset", required=True, metavar="PKG.MODULE:FACTORY", help="the dataset's factory")
    a.add_argument("--outputs", default="features=float32", metavar="NAME=CODEC,...", help="as for compute")
    a.add_argument("--keep", action="append", default=[], metavar="FIELD", help="as for compute, repeatable")
    a.add_argument("--input-key", default="input", metavar="KEY", help="as for compute (default input)")
    a.add_argument("--device", default="cpu", metavar="DEVICE", help="where A runs: cpu, cuda, cuda:N (default cpu)")
    a.add_argument("--batch-size", type=int, default=256, metavar="N", help="samples per forward of A (default 256)")
    a.add_argument("--read-batch-size", type=int, default=256, metavar="N", help="Model B's batch (default 256)")
    a.add_argument("--samples", type=int, default=1024, metavar="N",
                   help="samples measured (a scratch version of the first N, deleted after; default 1024)")
    a.add_argument("--samples-total", type=int, default=None, metavar="N", help="samples per epoch (default: all)")
    a.add_argument("--epochs", type=int, default=1, metavar="E", help="epochs per student (default 1)")
    a.add_argument("--views", type=int, default=1, metavar="K", help="augmented views stored (default 1)")
    a.add_argument("--students", type=int, default=1, metavar="S", help="students trained on it (default 1)")
    a.add_argument("--student", default=None, metavar="PKG.MODULE:FACTORY",
                   help="a factory returning step(batch), Model B's training step, to time it too")
    a.set_defaults(fn=cmd_advise)


def _add_simple(sub: Any, name: str, fn: Callable[[argparse.Namespace], Result],
                extra: Callable[[argparse.ArgumentParser], object]) -> None:
    p = sub.add_parser(name, help=_first_line(fn), description=_describe(fn.__doc__), epilog=EXIT_CODES_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    extra(p)
    p.set_defaults(fn=fn)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    p = _Parser(prog="featstore", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES_HELP,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_compute(sub)
    _add_advise(sub)
    _add_simple(sub, "list", cmd_list, lambda s: s.add_argument(
        "name", nargs="?", metavar="NAME", help="only this feature set (default: all)"))
    _add_simple(sub, "info", cmd_info, lambda s: s.add_argument("ref", metavar="REF", help=REF_HELP))
    _add_simple(sub, "verify", cmd_verify, lambda s: s.add_argument("ref", metavar="REF", help=REF_HELP))

    def export_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("ref", metavar="REF", help=REF_HELP)
        s.add_argument("dest", metavar="DEST", help="a new folder (any fsspec URL) for the Zarr v3 copy")
        s.add_argument("--dest-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an fsspec storage option of DEST, repeatable")
        s.add_argument("--no-verify", action="store_true", help="do not read the copy back against the digests")
    _add_simple(sub, "export", cmd_export, export_args)

    def tag_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("ref", metavar="REF", help=REF_HELP)
        s.add_argument("tag", metavar="TAG", help="the tag to set, e.g. best")
    _add_simple(sub, "tag", cmd_tag, tag_args)
    _add_simple(sub, "delete", cmd_delete, lambda s: s.add_argument("ref", metavar="REF", help=REF_HELP))

    def gc_args(s: argparse.ArgumentParser) -> None:
        s.add_argument("--older-than", type=float, default=3600.0, metavar="SECONDS",
                       help="only folders untouched this long (default 3600: a younger one may be a running compute)")
        s.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
        s.add_argument("--damaged", action="store_true", help="also delete versions whose manifest is damaged "
                       "(`featstore list` shows them; a newer featstore's are kept)")
    _add_simple(sub, "gc", cmd_gc, gc_args)

    k = sub.add_parser("cache", help=_first_line(cmd_cache), description=_describe(cmd_cache.__doc__),
                       epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("action", choices=["list", "clear"], help="list the cached versions, or clear entries")
    k.add_argument("--dir", default=None, metavar="DIR",
                   help="the cache folder given as cache_dir= (default $FEATSTORE_CACHE_DIR or ~/.cache/featstore)")
    k.add_argument("--unused", action="store_true", help="clear: only versions no live process reads")
    k.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text")
    k.add_argument("--debug", action="store_true", help=f"print the traceback of an error (or set {DEBUG_ENV}=1)")
    k.set_defaults(fn=cmd_cache)

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


def _emit(args: argparse.Namespace, result: Result, warned: list[str]) -> int:
    """Print a subcommand's result (with ``--json`` its document, the warnings added); its exit code."""
    if args.json:
        data = {**result.data, "warnings": warned} if warned and isinstance(result.data, dict) else result.data
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    elif result.text:
        print(result.text)
    return int(result.code)


@contextlib.contextmanager
def _warnings_on_one_line() -> Iterator[list[str]]:
    """featstore's warnings (:class:`FeatstoreWarning`) printed as ``featstore: warning: ...``
    on stderr, one line each, and collected for the JSON document; others as Python prints them."""
    warned: list[str] = []
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, FeatstoreWarning):
            warned.append(str(message))
            print(f"featstore: warning: {_one_line(message)}", file=sys.stderr)
        else:
            shown(message, category, *rest, **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("always", FeatstoreWarning)
        warnings.showwarning = show
        yield warned


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _fail(exc: BaseException, want_json: bool, debug: bool) -> int:
    """Report an error the way every command does: the traceback only when asked, one line on
    stderr, and with ``--json`` one JSON document on stdout."""
    code = exit_code(exc)
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    if code == Exit.INTERNAL:
        message = (f"internal error: {type(exc).__name__}: {exc}. This is a bug in featstore: rerun with --debug "
                   f"(or {DEBUG_ENV}=1) and report the traceback.")
    elif code == Exit.INTERRUPTED:
        message = "interrupted"
    else:
        message = str(exc)
    if want_json:
        print(json.dumps({"error": type(exc).__name__, "message": message, "exit_code": int(code)}))
    print(f"featstore: {'error: ' if code != Exit.INTERRUPTED else ''}{_one_line(message)}", file=sys.stderr)
    return int(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``featstore`` console script; returns the exit code.

    Every failure is one line on stderr (``featstore: error: ...``) and the exit code of its
    class (:data:`EXIT_CODES_HELP`); ``--json`` prints one JSON document on stdout either way.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Read before parsing: argparse's own errors must honour them too.
    want_json = "--json" in argv
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    try:
        args = build_parser().parse_args(argv)
        with _warnings_on_one_line() as warned:
            return _emit(args, args.fn(args), warned)
    except SystemExit:  # --help, --version
        raise
    except BaseException as exc:  # noqa: BLE001 - the one place a command's failure becomes an exit code
        return _fail(exc, want_json, debug)


if __name__ == "__main__":
    sys.exit(main())
