"""Real parts for every test: S3 servers on loopback (moto, SeaweedFS), a Dask LocalCluster, temp folders."""

from __future__ import annotations

import logging
import os
import sys

import pytest

# -- the environment the suite runs in --------------------------------------------------------
# The suite must pass the same on any machine, whatever the shell that starts it exports. These
# variables change what featstore or the parts under it do, so they are cleared or pinned here,
# at conftest import (before torch, botocore or Dask are imported by any test module), in
# os.environ: every child process (Dask worker processes, DataLoader workers, the subprocesses
# some tests start) inherits the same environment.

#: Cleared. AWS_MAX_ATTEMPTS / AWS_RETRY_MODE: featstore's S3 retry policy applies only when the
#: user sets none, and the fault tests count attempts (tests that need a user's setting set it
#: themselves). MALLOC_* / GLIBC_TUNABLES / LD_PRELOAD: featstore.allocator leaves a process whose
#: allocator the user configured alone, and a preloaded jemalloc/tcmalloc changes what glibc's
#: mallinfo2 reports. A profile, session token, endpoint, CA bundle or proxy would send the S3
#: tests' requests somewhere other than the loopback moto server, or sign them differently.
CLEARED = ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "GLIBC_TUNABLES", "LD_PRELOAD", "AWS_PROFILE",
           "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL",
           "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
           "https_proxy", "all_proxy", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
#: Pinned. OMP_NUM_THREADS=1: the cores are shared by the test process, two Dask worker processes
#: and DataLoader workers; unpinned, each would start one OpenMP thread per core (and torch in
#: this process reads it once, at import). No value depends on it: the test models compute
#: exactly (tests/models.py). S3 tests use the standard credential chain (environment), never
#: storage_options secrets, and never a config file of the user's. DASK_*: Dask's self-monitoring,
#: slowed for the suite's clusters (the session's LocalCluster, the embedded ones, `dask scheduler`
#: and `dask worker` subprocesses all read DASK_* at import). An idle LocalCluster of 2 workers
#: spent 0.13 CPU s per second on it (a statistical profile every 10 ms in each worker, memory
#: checks every 100 ms, an event-loop tick every 20 ms in every process), 0.02 with these: about
#: 180 CPU s over a run of the suite on 2 cores. No test reads them: none asserts a profile, none
#: sets a memory limit a worker must react to (tests/daskprocs.py: --memory-limit 0), and the tick
#: only times warnings.
PINNED = {"OMP_NUM_THREADS": "1", "AWS_ACCESS_KEY_ID": "testing-key", "AWS_SECRET_ACCESS_KEY": "testing-secret",
          "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
          "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true",
          "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
          "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
          "DASK_DISTRIBUTED__WORKER__MEMORY__MONITOR_INTERVAL": "1s",
          "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "1s", "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "2s"}
#: What this process inherited of those. glibc read MALLOC_*, GLIBC_TUNABLES and LD_PRELOAD when
#: this process started, so clearing them changes its children only: a test that inspects the
#: allocator of a process runs a fresh child (see test_compute).
INHERITED = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k in CLEARED or k in PINNED}
for _name in [k for k in os.environ if k.startswith("MALLOC_")] + list(CLEARED):
    os.environ.pop(_name, None)
os.environ.update(PINNED)
if "dask" in sys.modules:  # imported before this file (a plugin): read the variables again
    sys.modules["dask"].config.refresh()
if "torch" in sys.modules:  # imported before this file (a plugin): pin its threads directly
    sys.modules["torch"].set_num_threads(1)


# -- the quick lane ------------------------------------------------------------------------------
#: Tests of seconds each, marked ``slow`` here (one place, by measurement: ``--durations=0`` on
#: the 2-core machine, about 1.5 s or more): ``pytest -m "not slow"`` is the quick lane for
#: development (README, "Contributing"); the README's command runs everything. A whole file
#: (real process groups, Lightning, kills, fault schedules, races), or ``file::test`` (every
#: parameter of it). A new test of that cost goes here, or carries ``@pytest.mark.slow``.
SLOW = (
    "tests/read/test_ddp.py", "tests/test_lightning.py", "tests/storage/test_faults.py",
    "tests/compute/test_resume.py", "tests/compute/test_real_cluster.py", "tests/test_demo.py",
    "tests/versions/test_commit_races.py::test_concurrent_commits_",
    "tests/cli/test_cli.py::test_json_output_of_every_store_subcommand",
    "tests/codecs/test_ragged.py::test_extends_grows_token_sequences_and_reads_across_the_boundary",
    "tests/codecs/test_ragged.py::test_random_access_and_load_match_the_teachers_tokens",
    "tests/codecs/test_ragged.py::test_reader_yields_every_samples_tokens_once",
    "tests/codecs/test_softlabels.py::test_compute_stores_parts_and_every_read_path_returns_them",
    "tests/compute/test_compute.py::test_compression_choice_is_recorded_and_reads_back_exactly",
    "tests/compute/test_compute.py::test_embedded_cluster_leaves_callers_model_alone",
    "tests/compute/test_compute.py::test_a_taken_dashboard_port_is_said_once_in_featstores_words",
    "tests/compute/test_devices.py::test_embedded_per_gpu_cluster_gives_each_worker_process_its_own_gpu",
    "tests/compute/test_gpu_check_script.py::test_runs_every_step_on_the_cpu_and_writes_one_section",
    "tests/compute/test_incremental.py::test_deleting_or_gcing_the_parent_never_breaks_the_child",
    "tests/compute/test_incremental.py::test_extends_computes_only_new_samples_and_shares_the_parent_shards",
    "tests/format/test_spread.py::test_a_flipped_byte_in_a_spread_shard_is_detected",
    "tests/format/test_spread.py::test_delete_and_gc_remove_spread_objects_and_never_a_live_versions",
    "tests/format/test_spread.py::test_extends_a_spread_parent",
    "tests/format/test_spread.py::test_resume_skips_finished_spread_shards_and_adopts_the_claimed_spread",
    "tests/format/test_spread.py::test_spread_objects_land_under_several_prefixes_and_read_like_unspread",
    "tests/monitor/test_monitoring.py::test_a_failing_task_prints_one_clear_error_on_the_console",
    "tests/online/test_fill.py::test_fill_commits_what_compute_commits_then_reads_it",
    "tests/online/test_fill.py::test_fill_killed_mid_epoch_resumes_reading_what_it_stored",
    "tests/online/test_fill.py::test_fill_under_two_gloo_ranks_commits_one_version",
    "tests/online/test_fill.py::test_fill_with_partition_drop_and_no_shuffle_commits_in_the_first_epoch",
    "tests/online/test_fill.py::test_two_runs_filling_one_fingerprint_commit_one_version",
    "tests/read/test_cache.py::test_cache_gives_identical_batches",
    "tests/read/test_cache.py::test_folder_of_killed_users_is_swept_by_the_next_user",
    "tests/read/test_cache.py::test_folder_removed_when_the_last_user_exits",
    "tests/read/test_cache.py::test_mapped_chunks_are_checked_once_per_map_and_again_after_a_rewrite",
    "tests/read/test_cache.py::test_two_ranks_share_the_cache",
    "tests/read/test_cache.py::test_workers_share_one_copy_and_later_epochs_read_no_storage",
    "tests/read/test_clients.py::test_hugging_face_dataset_as_compute_dataset_and_source",
    "tests/read/test_clients.py::test_iterating_again_reads_the_next_epoch_and_set_epoch_wins",
    "tests/read/test_clients.py::test_stateful_dataloader_resumes_every_sample_exactly_once",
    "tests/read/test_dataset.py::test_fork_workers_after_parent_used_obstore",
    "tests/read/test_dataset.py::test_persistent_workers_follow_set_epoch_and_resume",
    "tests/read/test_dataset.py::test_s3_workers_after_parent_used_s3",
    "tests/read/test_diskcache.py::test_a_reader_killed_mid_fetch_leaves_the_cache_usable_and_counted",
    "tests/read/test_diskcache.py::test_batches_equal_the_uncached_ones_and_later_epochs_send_no_get",
    "tests/read/test_diskcache.py::test_cache_command_and_api_list_and_clear",
    "tests/read/test_diskcache.py::test_damaged_or_torn_entries_are_fetched_again_never_served",
    "tests/read/test_diskcache.py::test_workers_and_ranks_on_the_node_download_each_object_once",
    "tests/read/test_multi_teacher.py::test_batches_equal_each_teacher_read_alone",
    "tests/read/test_multi_teacher.py::test_on_seaweedfs_through_the_disk_cache_an_epoch_equals_each_teacher_alone",
    "tests/storage/test_secrets.py::test_sentinel_secret_never_leaks",
    "tests/test_edges.py::test_disk_full_is_store_full_and_commits_nothing",
    "tests/test_edges.py::test_sigkill_a_dask_worker_mid_compute",
    "tests/test_edges.py::test_tag_and_delete_threads",
    "tests/test_environment.py::test_conftest_overrides_a_hostile_shell",
    "tests/test_environment.py::test_dataloader_workers_see_the_pinned_environment",
    "tests/test_kd_ensemble.py::test_property_any_supports_and_mix_equal_the_dense_mix",
    "tests/test_legacy_store.py::test_legacy_s3_store_opens_verifies_and_reads",
    "tests/versions/test_corruption.py::test_all_zero_shards_are_stored_and_their_loss_detected",
    "tests/versions/test_corruption.py::test_bit_flips_through_dataloader_workers_",
    "tests/versions/test_corruption.py::test_missing_empty_or_truncated_object_raises",
    "tests/versions/test_scale.py::test_a_few_rows_of_a_big_shard_are_read_by_range",
    "tests/versions/test_views.py::test_each_view_reads_its_own_objects_through_the_memory_cache",
    "tests/versions/test_views.py::test_every_view_of_every_sample_once_over_k_epochs",
    "tests/versions/test_views.py::test_replay_reproduces_the_input_and_output_a_saw",
    "tests/versions/test_views.py::test_resume_mid_epoch_inside_a_view_cycle",
    "tests/versions/test_views.py::test_resume_recomputes_only_missing_view_shard_units",
    "tests/versions/test_views.py::test_view_receipts_compact_into_runs_and_a_resume_reads_them",
    "tests/storage/test_s3_servers.py::test_the_probe_runs_once_per_process_and_store",
    "tests/online/test_online.py::test_online_batches_equal_stored_batches",
    "tests/compute/test_compute.py::test_round_trip_equals_model_outputs",
    "tests/test_errors.py::test_output_shape_or_dtype_change_between_batches",
    "tests/cli/test_cli.py::test_quick_commands_import_neither_torch_nor_dask",
    "tests/test_edges.py::test_outputs_may_name_a_subset_of_what_a_returns",
    "tests/format/test_plain_readers.py::test_plain_readers_read_a_version_in_place_bit_for_bit_and_silently",
    "tests/hf/test_smollm2.py", "tests/hf/test_trainer.py::test_two_torchrun_ranks_read_and_train_on_disjoint_samples",
)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``/``logical``: one xdist worker more than xdist's own count of the cores. With
    one per core, a 2-core machine sat 19 % idle over the suite: many tests wait (fault stalls,
    timeouts, child processes and servers starting) with their core free. A count the user gave
    in PYTEST_XDIST_AUTO_NUM_WORKERS is taken as it is (None: xdist's hook reads it)."""
    from xdist.plugin import pytest_xdist_auto_num_workers as xdist_count

    return None if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else xdist_count(config) + 1


#: Rough seconds of a ``slow`` test and of another, on the 2-core machine: only their ratio
#: matters, to order the files below.
SLOW_S, QUICK_S = 10.0, 0.3
#: Files of a few tests of minutes each, by their own estimate (same units): tests/hf/test_vllm.py
#: converts SmolLM2, loads it in vLLM three times (here, a Dask worker, two servers) and in
#: transformers: it starts first, or it would be the last worker's tail.
FILE_COSTS = {"tests/hf/test_vllm.py": 400.0}


def pytest_collection_modifyitems(items):
    """Mark the tests of seconds each ``slow``, and order the files by their estimated cost,
    dearest first. ``--dist loadfile`` (pyproject.toml) hands whole files to the xdist workers in
    collection order (``--no-loadscope-reorder``; xdist's own order, by number of tests, put
    tests/storage/test_faults.py's few minute-long tests last, one worker running them alone at
    the end): the cheap files fill in behind the dear ones and the workers finish together."""
    cost: dict[str, float] = {}
    for item in items:
        slow = item.nodeid.split("[")[0].startswith(SLOW) or item.get_closest_marker("slow") is not None
        if slow:
            item.add_marker(pytest.mark.slow)
        path = item.nodeid.split("::")[0]
        cost[path] = cost.get(path, 0.0) + (SLOW_S if slow else QUICK_S)
    cost.update({path: c for path, c in FILE_COSTS.items() if path in cost})
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])  # stable: order within a file kept


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3 HTTP endpoint on 127.0.0.1 and a free port, for the whole session."""
    from featstore.testing import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory):
    """A real SeaweedFS S3 server (``weed server -s3``) on 127.0.0.1, for the whole session.

    Its one identity has the pinned AWS keys, so clients use the same credential chain as on
    moto. A server that cannot start fails the tests that need it (never a skip)."""
    from featstore.testing import SeaweedFS

    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), PINNED["AWS_ACCESS_KEY_ID"],
                   PINNED["AWS_SECRET_ACCESS_KEY"]) as server:
        yield server.endpoint


@pytest.fixture
def s3_server():
    """The S3 server a test's S3 fixtures use: moto, unless the test parametrizes ``s3_server``
    (``@both_servers`` from tests/servers.py runs it on moto and on SeaweedFS)."""
    return "moto"


@pytest.fixture
def s3_endpoint(request, s3_server):
    """The endpoint URL of the test's S3 server (see ``s3_server``)."""
    return request.getfixturevalue(f"{s3_server}_endpoint")


@pytest.fixture
def s3_url(s3_endpoint):
    """A fresh bucket per test on the test's S3 server; returns (url, storage_options)."""
    from .servers import new_bucket

    return f"s3://{new_bucket(s3_endpoint)}/feats", {"endpoint_url": s3_endpoint}


@pytest.fixture(params=["local", "moto"])
def store(request, tmp_path):
    """A FeatureStore on local disk and on S3 (moto), for contract tests run on both; a test
    parametrized with ``ALL_STORES`` (tests/servers.py) also gets one on SeaweedFS."""
    import featstore

    if request.param == "local":
        return featstore.open_store(tmp_path / "store")
    from .servers import new_bucket

    endpoint = request.getfixturevalue(f"{request.param}_endpoint")
    return featstore.open_store(f"s3://{new_bucket(endpoint)}/feats", storage_options={"endpoint_url": endpoint})


@pytest.fixture
def local_store(tmp_path):
    import featstore

    return featstore.open_store(tmp_path / "store")


@pytest.fixture(scope="session")
def dask_client():
    """One real LocalCluster (2 worker processes) shared by the compute tests."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           dashboard_address=":0", silence_logs=logging.ERROR)
    client = Client(cluster)
    yield client
    client.close()
    cluster.close()


@pytest.fixture(scope="session")
def shared_versions(tmp_path_factory, moto_endpoint):
    """The versions many test files read, written once per session on first use (see
    ``tests/helpers.py``: ``SharedVersions``); ``shared_versions["local"]`` and so on."""
    from .helpers import SharedVersions

    return SharedVersions(tmp_path_factory.mktemp("shared"), moto_endpoint)
