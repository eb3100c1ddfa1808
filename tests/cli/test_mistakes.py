"""The mistakes a new user makes (issue 22), through the API and the command line: each is a typed
error (a FeatstoreError that is also the matching builtin) whose message says what to do, maps to
the CLI's exit code and JSON document, and leaves no version visible; nothing is stored wrong."""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import warnings
from contextlib import redirect_stderr, redirect_stdout
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import featstore
from featstore import (ClusterUnavailable, ComputeFailed, ComputeOptions, DeviceSetupError, EmptyDataset,
                       FingerprintWarning, IncompatibleFormat, InvalidInput, InvalidName, MissingInputKey,
                       NonFiniteOutput, OutputMismatch, StoreNotFound, VersionNotFound)
from featstore.cli._main import EXIT_CODES_HELP, Exit, _fail, exit_code, main

from tests import daskprocs
from tests import mistakes as M
from tests.helpers import QUIET
from tests.models import NaNAt

NAME = "m/set"
ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def compute(store, client, model, data=None, outputs=None, options=QUIET, **kw):
    return store.compute(NAME, model=model, dataset=M.Vectors() if data is None else data, batch_size=8,
                         samples_per_shard=8, outputs=outputs or {"out": "float32"}, client=client, options=options,
                         **kw)


def with_options(**kw) -> ComputeOptions:
    return ComputeOptions(progress=False, **kw)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_report(exc: BaseException) -> tuple[int, dict, str]:
    """What the command line prints for ``exc`` with --json: (exit code, JSON document, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = _fail(exc, want_json=True, debug=False)
    return code, json.loads(out.getvalue()), err.getvalue()


def run_cli(argv: list[str]) -> tuple[int, Any, str]:
    """``featstore ARGV --json`` in this process: (exit code, the one JSON document, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([*argv, "--json"])
    return code, json.loads(out.getvalue()), err.getvalue()


def nothing_visible(store) -> bool:
    return store.versions(NAME) == [] and not any(k.endswith("manifest.json") for k in store.storage.find(""))


# ---------------------------------------------------------------------------------------------
# Through the API: each case, its error, the words of its fix, and the CLI's exit code for it.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    run: Callable[[Any, Any, Path], Any]
    error: type
    fix: str  # a regex the message must match: what to do
    code: Exit


TWO = {"a": "float32", "b": "float16"}
API_CASES = {
    # stored wrong before issue 22: inf stored, the manifest said max 1e300 and no inf
    "float64-beyond-float32": Case(lambda s, c, t: compute(s, c, M.Float64At(1e300)), NonFiniteOutput,
                                   r"overflow float32 in 1 samples \(first: \[5\].*scale or clamp.*allow_nonfinite",
                                   Exit.USAGE),
    "float64-beyond-bfloat16": Case(lambda s, c, t: compute(s, c, M.Float64At(1e300), outputs={"out": "bfloat16"}),
                                    NonFiniteOutput, r"overflow bfloat16 .*\[5\].*No featstore codec", Exit.USAGE),
    "float64-beyond-float32-int8": Case(lambda s, c, t: compute(s, c, M.Float64At(1e300), outputs={"out": "int8"}),
                                        NonFiniteOutput, r"\(first: \[5\]\), or values beyond float32's range",
                                        Exit.USAGE),
    "float32-beyond-float16": Case(lambda s, c, t: compute(s, c, M.Float64At(1e6), outputs={"out": "float16"}),
                                   NonFiniteOutput, r"overflow float16 .*\[5\].*'float32' or 'bfloat16'", Exit.USAGE),
    # errors that were not featstore's, or said the wrong thing
    "client-unreachable": Case(lambda s, c, t: compute(s, f"tcp://127.0.0.1:{closed_port()}", nn.Linear(4, 2),
                                                       options=with_options(connect_timeout=1)),
                               ClusterUnavailable, r"within 1 s.*dask scheduler.*connect_timeout", Exit.ENVIRONMENT),
    "client-malformed": Case(lambda s, c, t: compute(s, "localhost", nn.Linear(4, 2)), InvalidInput,
                             r"not a Dask scheduler address.*tcp://host:port", Exit.USAGE),
    "client-not-a-client": Case(lambda s, c, t: compute(s, 8786, nn.Linear(4, 2)), InvalidInput,
                                r"scheduler address such as 'tcp://scheduler:8786'", Exit.USAGE),
    "indexerror-in-getitem": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), M.IndexErrorAt()), ComputeFailed,
                                  r"dataset\[5\] raised IndexError.*len\(dataset\) is 24.*fix the dataset",
                                  Exit.COMPUTE_FAILED),
    "indexerror-in-getitem-dataset-id": Case(
        lambda s, c, t: compute(s, c, nn.Linear(4, 2), M.IndexErrorAt(), options=with_options(dataset_id="x")),
        ComputeFailed, r"dataset\[5\] raised IndexError.*len\(dataset\) is 24.*fix the dataset", Exit.COMPUTE_FAILED),
    "item-raises-in-fingerprint": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), M.RaisesAt()), ComputeFailed,
                                       r"dataset\[23\] raised ValueError: corrupt record 23.*fix the dataset",
                                       Exit.COMPUTE_FAILED),
    "pil-images": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), M.Images()), InvalidInput,
                       r"collating the input \('input'\).*PIL images: .*pil_to_tensor.*collate=", Exit.USAGE),
    "pil-images-dataset-id": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), M.Images(),
                                                          options=with_options(dataset_id="x")),
                                  InvalidInput, r"collating the input \('input'\).*pil_to_tensor", Exit.USAGE),
    "keep-strings": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), M.StringField(), keep=["path"]),
                         InvalidInput, r"keep field 'path' .*a str here.*leave it out of keep", Exit.USAGE),
    "keep-varying-shape": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), M.RaggedField(), keep=["boxes"]),
                               InvalidInput, r"keep field 'boxes' .*one fixed shape.*pad it", Exit.USAGE),
    "factory-on-cuda": Case(lambda s, c, t: compute(s, c, M.cuda_model), DeviceSetupError,
                            r"cuda_model asks for CUDA.*Build Model A on the CPU", Exit.ENVIRONMENT),
    "factory-raises": Case(lambda s, c, t: compute(s, c, M.broken_model), ComputeFailed,
                           r"broken_model raised RuntimeError: weights file.*fix it, then rerun", Exit.COMPUTE_FAILED),
    "model-class-needs-arguments": Case(lambda s, c, t: compute(s, c, nn.Linear), InvalidInput,
                                        r"needs arguments \(in_features, out_features\).*lambda: Linear", Exit.USAGE),
    "unknown-codec": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), outputs={"out": "float8"}), InvalidInput,
                          r"unknown output codec 'float8'.*float16, bfloat16, int8.*topk:K.*topp:.*sample:S",
                          Exit.USAGE),
    "store-is-a-file": Case(lambda s, c, t: featstore.open_store(_touch(t / "a-file")), InvalidInput,
                            r"is a file, not a folder; give the path of a folder", Exit.USAGE),
    "store-under-a-file": Case(lambda s, c, t: featstore.open_store(_touch(t / "a-file") / "store"), InvalidInput,
                               r"lies under .*a-file, which is a file", Exit.USAGE),
    "open-missing-store-read-only": Case(lambda s, c, t: featstore.open_store(t / "typo", create=False),
                                         StoreNotFound, r"no store at .*typo.*check the URL", Exit.NOT_FOUND),
    # the good ones that already worked
    "empty-dataset": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), M.Vectors(0)), EmptyDataset,
                          r"empty.*Check its path", Exit.USAGE),
    "missing-input-key": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), input_key="image"), MissingInputKey,
                              r"no input 'image' \(items are \['input', 'target'\]\); pass the right input_key",
                              Exit.USAGE),
    "bad-name": Case(lambda s, c, t: s.compute("../x", model=nn.Linear(4, 2), dataset=M.Vectors(), options=QUIET),
                     InvalidName, r"invalid feature-set name '\.\./x': use 1-8 '/'-separated segments", Exit.USAGE),
    "nan-output": Case(lambda s, c, t: compute(s, c, NaNAt(5)), NonFiniteOutput,
                       r"NaN/Inf in 'out' for 1 samples \(first: \[5\]\).*allow_nonfinite", Exit.USAGE),
    "output-not-returned": Case(lambda s, c, t: compute(s, c, nn.Linear(4, 2), outputs=TWO), OutputMismatch,
                                r"return a dict with those keys", Exit.USAGE),
    "unknown-version": Case(lambda s, c, t: s.open("no/such"), VersionNotFound, r"store.compute\('no/such'",
                            Exit.NOT_FOUND),
}


def _touch(path: Path) -> Path:
    path.write_text("")
    return path


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_mistake(case, local_store, dask_client, tmp_path):
    c = API_CASES[case]
    with pytest.raises(c.error) as err:
        c.run(local_store, dask_client, tmp_path)
    exc = err.value
    builtin = next(b for b in c.error.__mro__ if b.__module__ == "builtins" and b is not Exception)
    assert isinstance(exc, featstore.FeatstoreError) and isinstance(exc, builtin)
    assert re.search(c.fix, str(exc), re.S), str(exc)
    code, doc, stderr = cli_report(exc)
    assert code == c.code and doc == {"error": c.error.__name__, "message": str(exc), "exit_code": int(c.code)}
    assert stderr.startswith("featstore: error: ") and stderr.count("\n") == 1
    assert nothing_visible(local_store)


# ---------------------------------------------------------------------------------------------
# Through the command line (in this process: one JSON document, the exit code, one stderr line).
# ---------------------------------------------------------------------------------------------
def _compute_argv(root: str, model: str, dataset: str, *extra: str) -> list[str]:
    return ["compute", root, NAME, "--model", f"tests.mistakes:{model}", "--dataset", f"tests.mistakes:{dataset}",
            "--no-progress", "--batch-size", "8", "--samples-per-shard", "8", "--outputs", "out=float32", *extra]


CLI_CASES = {
    "model-factory-raises": (lambda r: _compute_argv(r, "broken_model", "vectors"), ComputeFailed, Exit.COMPUTE_FAILED,
                             r"broken_model'\) raised RuntimeError: weights file"),
    "dataset-factory-raises": (lambda r: _compute_argv(r, "linear", "broken_dataset"), ComputeFailed,
                               Exit.COMPUTE_FAILED, r"dataset factory .*raised FileNotFoundError.*fix it"),
    "item-raises": (lambda r: _compute_argv(r, "linear", "raising_items"), ComputeFailed, Exit.COMPUTE_FAILED,
                    r"dataset\[23\] raised ValueError"),
    "scheduler-unreachable": (lambda r: _compute_argv(r, "linear", "vectors", "--scheduler",
                                                      f"tcp://127.0.0.1:{closed_port()}", "--connect-timeout", "1"),
                              ClusterUnavailable, Exit.ENVIRONMENT, r"within 1 s.*--connect-timeout"),
    "scheduler-malformed": (lambda r: _compute_argv(r, "linear", "vectors", "--scheduler", "localhost"),
                            InvalidInput, Exit.USAGE, r"tcp://host:port"),
    "model-needs-arguments": (lambda r: ["compute", r, NAME, "--model", "torch.nn:Linear", "--dataset",
                                         "tests.mistakes:vectors"], InvalidInput, Exit.USAGE,
                              r"needs arguments.*name a function without arguments"),
    "missing-dataset-option": (lambda r: ["compute", r, NAME, "--model", "tests.mistakes:linear"], InvalidInput,
                               Exit.USAGE, r"required: --dataset.*featstore compute --help"),
    "unknown-option": (lambda r: ["list", r, "--colour"], InvalidInput, Exit.USAGE,
                       r"unrecognized arguments: --colour.*see `featstore list --help`"),
    "bad-storage-option": (lambda r: ["list", r, "--storage-option", "nonsense"], InvalidInput, Exit.USAGE,
                           r"is not KEY=VALUE"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_mistake(case, tmp_path):
    argv, error, code, fix = CLI_CASES[case]
    root = tmp_path / "store"
    got, doc, stderr = run_cli(argv(str(root)))
    assert got == code and doc["exit_code"] == int(code) and doc["error"] == error.__name__, doc
    assert re.search(fix, doc["message"], re.S), doc["message"]
    assert stderr.count("featstore: error: ") == 1 and "Traceback" not in stderr
    assert not root.exists()  # nothing claimed, nothing committed: not even an empty store folder is left


def test_cli_unknown_feature_set_names_the_command_that_computes_it(tmp_path):
    root = tmp_path / "store"
    featstore.open_store(root)
    for argv in (["info", str(root), NAME], ["verify", str(root), f"{NAME}@best"], ["delete", str(root), NAME]):
        got, doc, _ = run_cli(argv)
        assert got == Exit.NOT_FOUND and doc["error"] == "VersionNotFound", doc
        assert f"featstore compute {root} {NAME} --model" in doc["message"], doc["message"]
        assert "store.compute" not in doc["message"]  # the Python call is not what a shell user runs


def test_cli_store_path_is_a_file(tmp_path):
    path = _touch(tmp_path / "a-file")
    got, doc, _ = run_cli(_compute_argv(str(path), "linear", "vectors"))
    assert got == Exit.USAGE and doc["error"] == "InvalidInput" and "is a file" in doc["message"]
    assert path.read_text() == ""


@pytest.mark.parametrize("argv", [["list"], ["info", NAME], ["verify", NAME], ["tag", NAME, "best"],
                                  ["delete", f"{NAME}@0123456789abcdef"], ["gc"]])
def test_read_only_commands_never_create_a_store(argv, tmp_path):
    missing = tmp_path / "typo-store"
    got, doc, stderr = run_cli([argv[0], str(missing), *argv[1:]])
    assert got == Exit.NOT_FOUND and doc["error"] == "StoreNotFound" and "check the URL" in doc["message"]
    assert not missing.exists() and stderr.count("\n") == 1


def test_one_line_without_debug_and_the_traceback_with_it(tmp_path, monkeypatch, capsys):
    """The real console script prints one line and no traceback; --debug or FEATSTORE_DEBUG=1
    print the traceback too (in this process: the same main)."""
    path = _touch(tmp_path / "a-file")
    argv = ["compute", str(path), NAME, "--model", "tests.mistakes:linear", "--dataset", "tests.mistakes:vectors"]
    plain = subprocess.run([sys.executable, "-m", "featstore", *argv], env=daskprocs.child_env(), capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 2 and plain.stdout == ""
    assert len(plain.stderr.splitlines()) == 1 and plain.stderr.startswith("featstore: error: the store ")
    for env, extra in (("1", []), ("0", ["--debug"])):
        monkeypatch.setenv("FEATSTORE_DEBUG", env)
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1] == plain.stderr.rstrip()


def test_every_error_class_has_its_exit_code_in_the_readme():
    import inspect

    from featstore import errors

    classes = [c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.FeatstoreError)
               and c is not errors.FeatstoreError]
    for cls in classes:
        code = exit_code(cls("x"))
        assert code not in (Exit.OK, Exit.INTERNAL), cls  # an explicit row of the one map
        assert re.search(rf"^  {int(code)} ", EXIT_CODES_HELP, re.M), code
    # the `featstore --help` table is shown in the README or on a documentation page (docs/cli.md)
    pages = [README] + [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    for line in EXIT_CODES_HELP.splitlines()[1:]:
        assert any(line in page for page in pages), line
    assert {int(c) for c in Exit} == {int(m) for m in re.findall(r"^  (\d+) ", EXIT_CODES_HELP, re.M)}
    code, doc, stderr = cli_report(TypeError("oops"))  # not featstore's: a bug, said as one
    assert code == Exit.INTERNAL and "bug in featstore" in doc["message"] and "--debug" in stderr


# ---------------------------------------------------------------------------------------------
# Nothing stored wrong: what is stored, and what the manifest says about it.
# ---------------------------------------------------------------------------------------------
def test_overflow_allowed_is_stored_as_inf_and_the_statistics_say_so(local_store, dask_client):
    v = compute(local_store, dask_client, M.Float64At(1e300), options=with_options(allow_nonfinite=True))
    st = v.manifest.stats["out"]
    assert torch.isinf(v[M.BAD]["out"]).all() and (v[0]["out"] == 1).all()
    assert st["inf"] == 2 and st["nonfinite_samples"] == [M.BAD] and st["max"] == 1.0  # what is stored
    assert v.verify() == []


def test_float64_rounded_to_float32_is_a_recorded_codec_error(local_store, dask_client):
    value = 1 + 1e-12
    v = compute(local_store, dask_client, M.Float64At(value, base=value))
    want = abs(float(torch.tensor(value, dtype=torch.float32)) - value)
    assert v.manifest.stats["out"]["max_abs_error"] == pytest.approx(want, rel=1e-6) and want > 0
    assert v[0]["out"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Warnings when the fingerprint is likely blind.
# ---------------------------------------------------------------------------------------------
def test_model_holding_a_function_warns_naming_model_id(local_store, dask_client):
    torch.manual_seed(0)
    model = M.Wrap(lambda y: y * 2)
    with pytest.warns(FingerprintWarning, match=r"Wrap.fn = .*<lambda>.*model_id="):
        first = compute(local_store, dask_client, model)
    model.fn = lambda y: y * 3  # invisible to the fingerprint, as the warning said
    with pytest.warns(FingerprintWarning):
        assert compute(local_store, dask_client, model).id == first.id
    with warnings.catch_warnings():
        warnings.simplefilter("error", FingerprintWarning)  # named: no warning
        named = compute(local_store, dask_client, model, options=with_options(model_id="wrap-times-3"))
    assert named.id != first.id


def test_blind_spots_flags_plain_functions_and_hooks_not_torch_modules():
    from featstore.versions._fingerprints import blind_spots

    assert blind_spots(nn.TransformerEncoderLayer(8, 2)) == []  # its activation is torch's F.relu
    lin = nn.Linear(2, 2)
    lin.register_forward_hook(lambda m, i, o: o * 2)
    holder = nn.Sequential(lin)
    holder.post = [abs, lambda x: x]  # the lambda, not the builtin
    assert blind_spots(holder) == ["Sequential.post = <lambda>", "1 forward hook(s) on Linear '0'"]


def test_dataset_with_random_items_warns_naming_dataset_id(local_store, dask_client):
    with pytest.warns(FingerprintWarning, match=r"dataset\[0\] gave two different items.*dataset_id="):
        compute(local_store, dask_client, nn.Linear(4, 2), M.RandomItems())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FingerprintWarning)
        compute(local_store, dask_client, nn.Linear(4, 2), M.RandomItems(), options=with_options(dataset_id="r"))
        compute(local_store, dask_client, nn.Linear(4, 2), M.Vectors())  # deterministic items: no warning


def test_cli_prints_warnings_on_one_line_and_in_the_json(tmp_path, capsys):
    from featstore.cli._main import _warnings_on_one_line

    with _warnings_on_one_line() as warned:
        warnings.warn(FingerprintWarning("Model A holds code\nits fingerprint cannot see"), stacklevel=1)
    assert warned == ["Model A holds code\nits fingerprint cannot see"]
    assert capsys.readouterr().err == "featstore: warning: Model A holds code its fingerprint cannot see\n"


# ---------------------------------------------------------------------------------------------
# Repairable stores: a damaged manifest affects only its own version.
# ---------------------------------------------------------------------------------------------
def test_a_damaged_manifest_affects_only_its_version(tmp_path, dask_client):
    root = tmp_path / "store"
    store = featstore.open_store(root)
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    good = compute(store, dask_client, lin, M.Vectors(16))
    bad = compute(store, dask_client, lin, M.Vectors(24))
    other = compute(store, dask_client, lin, M.Vectors(20))
    store.tag(other, "best")
    for v, text in ((bad, "{not json"), (other, json.dumps({"schema": "featstore.manifest", "schema_version": 1}))):
        (root / NAME / "_versions" / v.id / "manifest.json").write_text(text)
    assert [v.id for v in store.versions(NAME)] == [good.id]
    damaged = store.damaged()
    assert set(damaged) == {bad.ref, other.ref} and "not valid JSON" in damaged[bad.ref]
    assert f"featstore delete {root} {bad.ref}" in damaged[bad.ref]
    assert store.open(good.ref).id == good.id and len(store.open(good.ref).load()["out"]) == 16
    with pytest.raises(IncompatibleFormat, match=r"newest version of 'm/set' cannot be told.*name@id|m/set@<id>"):
        store.open(NAME)
    code, rows, _ = run_cli(["list", str(root)])
    assert code == 0 and {(r["version"], r["damaged"] is not None) for r in rows} == {
        (good.id, False), (bad.id, True), (other.id, True)}
    assert store.gc(older_than=0) == [] and (root / NAME / "_versions" / bad.id).exists()
    would = store.gc(older_than=0, damaged=True, dry_run=True)
    assert f"{NAME}/_versions/{bad.id}/manifest.json" in would and all(good.id not in k for k in would)
    code, doc, _ = run_cli(["delete", str(root), bad.ref])
    assert code == 0 and doc == {"name": NAME, "version": bad.id, "deleted": True}
    assert not (root / NAME / "_versions" / bad.id).exists()
    assert store.delete(f"{NAME}@best") == other.ref  # by its tag, which goes with it
    assert store.tags(NAME) == {} and not (root / NAME / "_versions" / other.id).exists()
    assert store.open(NAME).id == good.id and store.damaged() == {}
    (root / NAME / "_tags" / "broken.json").write_text("nope")  # a damaged tag hides only itself
    assert store.tags(NAME) == {} and run_cli(["list", str(root)])[0] == 0
    with pytest.raises(IncompatibleFormat, match="broken.json is not valid JSON"):
        store.open(f"{NAME}@broken")


def test_gc_damaged_deletes_damaged_versions_and_keeps_newer_ones(tmp_path, dask_client):
    root = tmp_path / "store"
    store = featstore.open_store(root)
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    # newer first: computed second, it would reference bad's shards (the same first 16 items), and gc
    # rightly keeps data a live version reads
    newer = compute(store, dask_client, lin, M.Vectors(24))
    bad = compute(store, dask_client, lin, M.Vectors(16))
    (root / NAME / "_versions" / bad.id / "manifest.json").write_bytes(b"\x80garbage")
    m = json.loads((root / NAME / "_versions" / newer.id / "manifest.json").read_text())
    (root / NAME / "_versions" / newer.id / "manifest.json").write_text(json.dumps({**m, "schema_version": 99}))
    assert "upgrade featstore" in store.damaged()[newer.ref]
    deleted = store.gc(older_than=3600, damaged=True)
    assert any(k.startswith(f"{NAME}/_versions/{bad.id}/") for k in deleted)
    assert not (root / NAME / "_versions" / bad.id).exists() and (root / NAME / "_versions" / newer.id).exists()


def test_a_version_deleted_after_its_dataset_was_built_reads_as_deleted(local_store, dask_client):
    v = compute(local_store, dask_client, nn.Linear(4, 2))
    ds = local_store.dataset(v.ref, batch_size=4)
    local_store.delete(v.ref)
    with pytest.raises(VersionNotFound, match=r"was deleted \(store.delete\) while it was being read.*another version"):
        next(iter(ds))
