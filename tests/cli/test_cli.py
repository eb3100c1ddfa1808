"""The ``featstore`` command line: help texts, --json on every subcommand, storage options."""

from __future__ import annotations

import json

import pytest

from featstore.cli._main import build_parser, main, parse_outputs, parse_value

from tests.helpers import QUIET, write_version
from tests.servers import ALL_STORES, new_bucket


def _subparsers():
    p = build_parser()
    return next(a for a in p._actions if a.dest == "command").choices


def test_every_subcommand_and_option_has_help_and_the_common_options():
    subs = _subparsers()
    assert set(subs) == {"compute", "advise", "list", "info", "verify", "export", "tag", "delete", "gc", "cache",
                         "demo"}
    for name, sp in subs.items():
        opts = {o for a in sp._actions for o in a.option_strings}
        # "cache" works on this node's disk cache, not on a store: no storage options
        assert ({"--json"} if name == "cache" else {"--storage-option", "--json"}) <= opts, name
        assert "exit codes:" in (sp.epilog or ""), name
        for a in sp._actions:
            assert a.help and len(a.help) > 8, (name, a.dest)


def test_the_command_line_page_shows_the_real_help_and_every_command(capsys, monkeypatch):
    """docs/cli.md's `featstore --help` is the real output (at 100 columns, as the page says) and
    every subcommand is on the page by its name (`featstore <command>`)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = page.split("$ featstore --help\n", 1)[1].split("```", 1)[0]
    assert shown == capsys.readouterr().out
    for name in _subparsers():
        assert f"`featstore {name}" in page or f"`{name}`" in page, name


def test_option_parsing():
    assert parse_outputs("features=float16, logits=float32") == {"features": "float16", "logits": "float32"}
    assert parse_value("8") == 8 and parse_value("false") is False and parse_value("a:b") == "a:b"


@pytest.mark.parametrize("where", ALL_STORES)
def test_json_output_of_every_store_subcommand(tmp_path, capsys, where, request):
    import featstore

    if where == "local":
        root, options = str(tmp_path / "store"), {}
    else:  # an S3 server, reached through --storage-option as a user would
        endpoint = request.getfixturevalue(f"{where}_endpoint")
        root, options = f"s3://{new_bucket(endpoint)}/feats", {"endpoint_url": endpoint}
    store = featstore.open_store(root, storage_options=options or None)
    v = write_version(store, "c/set", n=64, outputs={"features": "float32", "logits": "float32"}, keep=(),
                      batch_size=16, options=QUIET)

    def run(*argv: str) -> tuple[int, object]:
        code = main([*argv, *(a for k, val in options.items() for a in ("--storage-option", f"{k}={val}")), "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, rows = run("list", root)
    assert code == 0 and [(r["name"], r["version"], r["samples"]) for r in rows] == [("c/set", v.id, 64)]
    code, info = run("info", root, "c/set")
    assert code == 0 and info["id"] == v.id
    code, out = run("tag", root, f"c/set@{v.id}", "best")
    assert code == 0 and out == {"name": "c/set", "tag": "best", "version": v.id}
    code, out = run("verify", root, "c/set@best")
    assert code == 0 and out["ok"] and out["problems"] == []
    code, out = run("export", root, "c/set@best", str(tmp_path / "copy.zarr"))
    # 2 shards of 3 arrays: the two outputs and the input digests
    assert code == 0 and out["version"] == v.id and out["shards_checked"] == 2 * 3 and out["objects"] == 2 * 3
    code, out = run("gc", root, "--older-than", "0", "--dry-run")
    assert code == 0 and out["dry_run"] and all("/manifest.json" not in k for k in out["deleted"])
    code, out = run("delete", root, "c/set@best")
    assert code == 0 and out["deleted"]
    code, out = run("info", root, "c/set")
    assert code == 4 and out["error"] == "VersionNotFound"
    # Nothing is left to collect: no object, and no folder a server keeps a while (SeaweedFS).
    code, out = run("gc", root, "--older-than", "0")
    assert code == 0 and out["deleted"] == [] and store.storage.find("") == []


@pytest.mark.parametrize("option", ["endpoint_url=http://127.0.0.1:1", "anon=true"])
def test_storage_options_reach_the_store(tmp_path, capsys, option):
    # An unreachable endpoint is a store-unavailable exit (3), not a traceback. One attempt (a
    # JSON option value; the budget itself is tests/storage/test_faults.py's): no backoff waits.
    code = main(["list", "s3://no-bucket/x", "--storage-option", option,
                 "--storage-option", "endpoint_url=http://127.0.0.1:1", "--storage-option",
                 'config_kwargs={"retries": {"mode": "standard", "total_max_attempts": 1}}', "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 3 and out["error"] == "StoreUnavailable"


QUICK_COMMANDS = (["--help"], ["list", "{root}"], ["info", "{root}", "legacy/tiny"],
                  ["verify", "{root}", "legacy/tiny"], ["tag", "{root}", "legacy/tiny", "quick"],
                  ["delete", "{root}", "legacy/bf"],
                  ["gc", "{root}", "--dry-run"], ["cache", "list", "--dir", "{cache}"])
HEAVY = ("torch", "dask", "distributed", "bokeh")
#: What the commands that only read JSON manifests, tags and listings never import either (about
#: half of `featstore list`'s start-up when they did): verify reads the arrays, so it imports both.
ARRAYS = ("zarr", "numpy")


@pytest.mark.parametrize("argv", QUICK_COMMANDS, ids=lambda a: a[0].lstrip("-"))
def test_quick_commands_import_neither_torch_nor_dask(argv, tmp_path):
    """featstore --help, list, info, verify, tag, delete, gc and cache run without importing
    torch, Dask or bokeh (seconds of start-up), and all but verify without zarr or numpy: what
    the process has imported when it exits."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path / "store"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "store-0.1.0", root)
    args = [a.format(root=root, cache=tmp_path / "cache") for a in argv]
    forbidden = HEAVY if argv[0] == "verify" else HEAVY + ARRAYS
    code = ("import sys\nfrom featstore.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
            "except SystemExit as e:\n    code = e.code\n"
            f"print('HEAVY', sorted(m for m in {forbidden!r} if m in sys.modules))\n"
            "sys.exit(code)")
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "HEAVY []", run.stdout[-500:]
