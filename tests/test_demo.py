"""``featstore demo`` on a small N: what it prints when it computes, and when it runs again and
the compute is skipped (the version is already in the store)."""

from __future__ import annotations

from featstore.demo import run_demo


def test_a_second_run_says_the_compute_was_skipped_and_which_time_it_shows(tmp_path, capsys, dask_client):
    root = str(tmp_path / "demo")
    first = run_demo(root, n=256, epochs=1, batch_size=64, client=dask_client)
    out = capsys.readouterr().out
    assert not first["compute_skipped"] and "compute skipped" not in out
    assert "of which compute (Dask, incl. start-up)" in out and "x end to end," in out

    again = run_demo(root, n=256, epochs=1, batch_size=64, client=dask_client)
    out = capsys.readouterr().out
    assert again["compute_skipped"] and "compute skipped: the version was already in the store" in out
    # the compute figure is the one the version recorded when it was computed, and is labelled so
    import featstore

    recorded = featstore.open_store(root).open("demo/cnn-a").manifest.timings["total_s"]
    assert again["compute_s"] == recorded
    assert "of which compute (recorded when it ran)" in out and "x end to end (with the recorded compute time)" in out
