"""Which device each worker uses, and the embedded cluster's GPU layout: decided by pure
functions, tested here on a machine without GPUs (grids of workers x visible devices), plus one
real LocalCluster started with fake GPU ids to show each worker process gets its own."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from featstore.compute._devices import (ClusterPlan, WorkerView, _Slots, choose_device, gpu_worker_specs, name_index,
                               plan_cluster, task_device, visible_gpu_ids)
from featstore.errors import DeviceSetupError, FeatstoreError

WORKERS = [1, 2, 3, 4, 8]
VISIBLE = [0, 1, 2, 4, 8]


def _rotate(ids: list[str], i: int) -> list[str]:
    """dask-cuda's CUDA_VISIBLE_DEVICES for its worker i: the list rotated so GPU i comes first."""
    return ids[i:] + ids[:i]


@pytest.mark.parametrize("visible", VISIBLE)
@pytest.mark.parametrize("n", WORKERS)
def test_named_workers_seeing_every_gpu_spread_over_them(n, visible):
    """A user's LocalCluster(resources={"GPU": 1}) on a machine with `visible` GPUs: workers
    0..n-1 all see every GPU; each takes its own while there are enough, evenly after that."""
    devices = [choose_device(WorkerView(name=i, resources={"GPU": 1}, visible=visible)).device for i in range(n)]
    if visible == 0:
        assert devices == ["cpu"] * n
        return
    if n <= visible:
        assert len(set(devices)) == n  # never GPU 0 for everyone
    counts = Counter(devices)
    assert max(counts.values()) - min(counts.values()) <= 1
    assert len(counts) == min(n, visible)


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("n", WORKERS)
def test_embedded_per_gpu_workers_each_own_one_physical_gpu(n, gpus):
    """Without dask-cuda: worker i sees one GPU (its CUDA_VISIBLE_DEVICES) and uses cuda:0 there,
    so the physical GPUs in use are distinct while n <= gpus, round-robin beyond."""
    ids = visible_gpu_ids(None, gpus)
    plan = plan_cluster(ids, n, None, dask_cuda=False)
    assert plan.kind == "per-gpu" and plan.n_workers == n
    physical = []
    for i in range(n):
        env = plan.worker_env(i)["CUDA_VISIBLE_DEVICES"]
        seen = visible_gpu_ids(env, len(env.split(",")))
        assert len(seen) == 1
        dev = choose_device(WorkerView(name=i, resources={"GPU": 1}, visible=len(seen))).device
        assert dev == "cuda:0"
        physical.append(seen[int(dev.split(":")[1])])
    assert len(set(physical)) == min(n, gpus)
    assert max(Counter(physical).values()) == -(-n // gpus)


#: dask-cuda's own examples of the CUDA_VISIBLE_DEVICES it gives worker i
#: (``dask_cuda.utils.cuda_visible_devices``'s doctests): the list rotated so GPU i comes first.
DASK_CUDA_EXAMPLES = {(0, "0,1,2,3"): "0,1,2,3", (3, "0,1,2,3,4,5,6,7"): "3,4,5,6,7,0,1,2"}


def test_rotate_is_what_dask_cuda_documents():
    for (i, visible), env in DASK_CUDA_EXAMPLES.items():
        assert ",".join(_rotate(visible.split(","), i)) == env
    try:  # and what it does, where it is installed (pip install featstore[gpu])
        from dask_cuda.utils import cuda_visible_devices
    except ImportError:
        return
    for (i, visible), env in DASK_CUDA_EXAMPLES.items():
        assert cuda_visible_devices(i, visible.split(",")) == env
    assert cuda_visible_devices(1, ["3", "4", "5"]) == ",".join(_rotate(["3", "4", "5"], 1))


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_dask_cuda_workers_use_their_first_visible_gpu(gpus):
    """dask-cuda rotates CUDA_VISIBLE_DEVICES per worker; cuda:0 is then each worker's own GPU,
    whatever its name (LocalCUDACluster names workers by GPU id, `dask cuda worker` "name-i"):
    the physical GPU each worker uses, read through featstore's own parsing of the variable, is
    GPU ``ids[i]`` of the machine, each exactly once."""
    ids = [str(3 + i) for i in range(gpus)]  # a machine whose usable GPUs are 3, 4, ...
    plan = plan_cluster(ids, None, None, dask_cuda=True)
    assert plan == ClusterPlan("dask-cuda", gpus, tuple(ids))
    for i in range(gpus):
        env = ",".join(_rotate(list(plan.gpu_ids), i))  # dask-cuda's worker i, as documented
        seen = visible_gpu_ids(env, gpus)  # what the worker process parses
        for name in (ids[i], f"node-{i}", None):
            a = choose_device(WorkerView(name=name, resources={"GPU": 1}, visible=len(seen), dask_cuda=True))
            assert seen[int(a.device.split(":")[1])] == ids[i], (i, name, env, a)


def test_more_workers_than_gpus_do_not_use_dask_cuda():
    """LocalCUDACluster refuses more workers than GPUs: featstore's own per-GPU cluster shares them."""
    assert plan_cluster(["0", "1"], 4, None, dask_cuda=True).kind == "per-gpu"
    assert plan_cluster(["0", "1"], 2, True, dask_cuda=True).kind == "dask-cuda"


@pytest.mark.parametrize("processes, kind", [(None, "thread"), (False, "thread"), (True, "processes")])
def test_no_gpu_plans(processes, kind):
    plan = plan_cluster([], None, processes, dask_cuda=True)
    assert (plan.kind, plan.n_workers, plan.gpu_ids, plan.worker_env(0)) == (kind, 1, (), {})
    assert plan.processes == (kind != "thread")


def test_worker_threads_with_gpus_pick_by_name():
    plan = plan_cluster(["0", "1"], None, False, dask_cuda=False)
    assert plan == ClusterPlan("thread", 2, ("0", "1")) and not plan.processes
    assert [choose_device(WorkerView(name=i, visible=2)).device for i in range(2)] == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_gpu_worker_specs_for_fake_gpus(n):
    """The worker specs handed to Dask: worker i's own CUDA_VISIBLE_DEVICES, a GPU resource, the
    base options (thread caps) kept, and the base spec itself not changed."""
    ids = tuple(f"GPU-{i:04d}" for i in range(n))
    base = {"cls": object, "options": {"nthreads": 1, "env": {"OMP_NUM_THREADS": "2"}}}
    specs = gpu_worker_specs(plan_cluster(ids, None, True, dask_cuda=False), base)
    assert list(specs) == list(range(n))
    assert [s["options"]["env"] for s in specs.values()] == [
        {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ids[i]} for i in range(n)]
    assert all(s["options"]["resources"] == {"GPU": 1} and s["options"]["nthreads"] == 1 for s in specs.values())
    assert base["options"] == {"nthreads": 1, "env": {"OMP_NUM_THREADS": "2"}}


@pytest.mark.parametrize("env, count, want", [
    (None, 0, ()), (None, 3, ("0", "1", "2")), ("2,0", 2, ("2", "0")), (" 5 , 7 ", 2, ("5", "7")),
    ("1,2,3", 2, ("1", "2")), ("MIG-abc,GPU-def", 2, ("MIG-abc", "GPU-def")), ("", 0, ()),
])
def test_visible_gpu_ids(env, count, want):
    assert visible_gpu_ids(env, count) == want


@pytest.mark.parametrize("name, want", [
    (0, 0), (7, 7), ("3", 3), ("gpu-3", 3), ("node1-gpu12", 12), ("worker_5", 5), (None, None), (-1, None),
    ("tcp://127.0.0.1:40123", None), ("10.0.0.7", None), ("alpha", None), (True, None), ("w-123456", None),
])
def test_name_index(name, want):
    assert name_index(name) == want


def test_hand_started_worker_with_several_gpus_picks_by_name():
    """`dask worker --name gpu-3` on a machine showing it four GPUs: cuda:3, not cuda:0."""
    a = choose_device(WorkerView(name="gpu-3", resources={"GPU": 1}, visible=4))
    assert a.device == "cuda:3" and "gpu-3" in a.reason


def test_hand_started_worker_owning_several_gpus_gives_each_task_a_slot():
    """`dask worker --nthreads 4 --resources GPU=4`: four concurrent tasks, four devices."""
    view = WorkerView(name="tcp://10.0.0.1:4000", resources={"GPU": 4}, visible=4)
    assert [choose_device(view, s).device for s in range(4)] == [f"cuda:{s}" for s in range(4)]
    with pytest.raises(DeviceSetupError):
        choose_device(view, None)
    with pytest.raises(DeviceSetupError, match="advertises GPU=4 but sees only 2"):
        choose_device(WorkerView(name="w", resources={"GPU": 4}, visible=2), 0)


def test_ambiguous_worker_raises_and_says_what_to_do():
    """Several GPUs, no usable name, one GPU resource: an error, never a silent cuda:0."""
    with pytest.raises(DeviceSetupError) as info:
        choose_device(WorkerView(name="tcp://127.0.0.1:40123", resources={"GPU": 1}, visible=4))
    msg = str(info.value)
    assert "4 GPUs" in msg and "CUDA_VISIBLE_DEVICES" in msg and "FEATSTORE_DEVICE" in msg
    assert isinstance(info.value, FeatstoreError) and isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("value, visible, want", [
    ("cpu", 4, "cpu"), ("CPU", 0, "cpu"), ("cuda", 2, "cuda:0"), ("cuda:1", 2, "cuda:1"), (" cuda:3 ", 4, "cuda:3"),
])
def test_override(value, visible, want):
    view = WorkerView(name="tcp://x:1", resources={"GPU": 4}, visible=visible, dask_cuda=True, override=value)
    assert choose_device(view).device == want


@pytest.mark.parametrize("value, visible", [("cuda:2", 2), ("cuda", 0), ("gpu", 2), ("cuda:-1", 4)])
def test_bad_override(value, visible):
    with pytest.raises(DeviceSetupError, match="FEATSTORE_DEVICE"):
        choose_device(WorkerView(visible=visible, override=value))


def test_bad_worker_count():
    with pytest.raises(DeviceSetupError, match="n_workers"):
        plan_cluster(["0"], 0, None, dask_cuda=False)


def test_slots_are_distinct_across_threads_and_bounded():
    slots = _Slots()
    got, barrier, errors = [], threading.Barrier(4), []

    def task():
        try:
            with slots.take(4) as s:
                got.append(s)
                barrier.wait(timeout=10)  # all four hold a slot at once
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=task) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(got) == [0, 1, 2, 3]
    with slots.take(1) as s0:
        assert s0 == 0
        with pytest.raises(DeviceSetupError, match="GPU=1"):
            with slots.take(1):
                pass
    with slots.take(1) as again:  # released
        assert again == 0


def test_task_device_on_a_cpu_only_view():
    with task_device(WorkerView(name=0, visible=0)) as dev:
        assert dev.type == "cpu"


def _resources(dask_worker) -> dict:
    return dict(dask_worker.state.total_resources)


def test_embedded_per_gpu_cluster_gives_each_worker_process_its_own_gpu():
    """A real LocalCluster started from a per-GPU plan for two fake GPU ids: each worker process
    has its own CUDA_VISIBLE_DEVICES and a GPU resource, and compute tasks ask for one GPU.
    (No CUDA here: the workers see no device and fall back to the CPU.)"""
    from featstore.compute._cluster import start, task_resources
    from featstore.compute._devices import worker_devices

    cluster = start(plan_cluster(["7", "3"], None, None, dask_cuda=False))
    try:
        seen = worker_devices(cluster.client)
        by_name = {info["name"]: info for info in seen.values()}
        assert sorted(by_name) == [0, 1]
        assert [by_name[i]["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["7", "3"]
        assert all(info["device"] == "cpu" and info["visible"] == 0 for info in seen.values())
        assert list(cluster.client.run(_resources).values()) == [{"GPU": 1}, {"GPU": 1}]
        assert task_resources(cluster.client) == {"GPU": 1}
        assert not cluster.in_process
    finally:
        cluster.close()
