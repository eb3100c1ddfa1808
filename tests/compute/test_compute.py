"""Compute on a real LocalCluster, read back on local disk and S3: round-trip and versions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import featstore
from featstore import ComputeOptions, InvalidInput, VersionNotFound
from featstore.compute._driver import choose_layout
from featstore.versions import stored

from tests.helpers import QUIET
from tests.models import CountingA, TinyA, VectorData, assert_close_across_processes
from tests.servers import ALL_STORES

OUTPUTS = {"features": "float16", "logits": "float32"}


def compute(store, client, name="tiny/train", model=None, data=None, **kw):
    kw.setdefault("outputs", OUTPUTS)
    kw.setdefault("keep", ["target"])
    kw.setdefault("samples_per_shard", 64)
    kw.setdefault("batch_size", 16)
    kw.setdefault("options", QUIET)
    return store.compute(name, model=model or TinyA(), dataset=data or VectorData(300),
                         client=client, **kw)


@pytest.mark.parametrize("store", ALL_STORES, indirect=True)
def test_round_trip_equals_model_outputs(store, dask_client):
    data = VectorData(300)
    model = TinyA()
    v = compute(store, dask_client, model=model, data=data)
    assert len(v) == 300 and v.manifest.layout.n_shards == 5
    with torch.inference_mode():
        ref = model.eval()(data.x)
    got = v.load()
    assert got["logits"].dtype == torch.float32
    assert torch.equal(got["logits"], ref["logits"])  # float32 stored exactly
    assert torch.equal(got["features"], ref["features"].to(torch.float16))  # float16 is the cast
    assert torch.equal(got["target"], data.y)
    assert torch.equal(got["index"], torch.arange(300))
    part = v[[5, 299, 17]]
    assert torch.equal(part["logits"], ref["logits"][[5, 299, 17]])
    assert torch.equal(v[7]["features"], ref["features"][7].half())
    stats = v.manifest.stats["logits"]
    assert stats["count"] == 300 * 5 and stats["nan"] == 0
    assert stats["min"] == pytest.approx(float(ref["logits"].min()))
    assert stats["mean"] == pytest.approx(float(ref["logits"].mean()), rel=1e-5)
    assert v.manifest.stats["features"]["max_abs_error"] > 0


def test_bfloat16_codec_round_trip(local_store, dask_client):
    data, model = VectorData(100), TinyA()
    v = compute(local_store, dask_client, data=data, model=model, outputs={"features": "bfloat16", "logits": "float32"})
    with torch.inference_mode():
        ref = model.eval()(data.x)
    assert torch.equal(v.load()["features"], ref["features"].to(torch.bfloat16))


def test_plain_zarr_reads_a_committed_version(store, dask_client):
    data, model = VectorData(130), TinyA()
    v = compute(store, dask_client, data=data, model=model)
    group = zarr.open_group(v.url, mode="r", storage_options=None if store.storage.is_local
                            else store.storage._options)
    with torch.inference_mode():
        ref = model.eval()(data.x)
    np.testing.assert_array_equal(group["logits"][:], ref["logits"].numpy())
    assert group["features"].dtype == np.float16 and group["features"].shape == (130, 8)
    assert group["logits"].shards == (64, 5)


@pytest.mark.parametrize("compression", ["auto", "zstd", "none"])
def test_compression_choice_is_recorded_and_reads_back_exactly(store, dask_client, compression):
    from featstore.format import _arrays as codecs

    data, model = VectorData(200), TinyA()
    v = compute(store, dask_client, data=data, model=model, batch_size=64,
                options=ComputeOptions(progress=False, compression=compression))
    with torch.inference_mode():
        ref = model.eval()(data.x)
    first = {"features": ref["features"][:64].half().numpy(), "logits": ref["logits"][:64].numpy(),
             "target": data.y[:64].numpy()}
    for name, spec in v.manifest.arrays.items():
        if spec.source == "digest":  # the input digests: random bytes, which "auto" never compresses
            assert spec.compression == ("zstd" if compression == "zstd" else "none")
            continue
        want = compression if compression != "auto" else codecs.choose_compression(
            "auto", codecs.zstd_saving(first[name]), local=store.storage.is_local)
        assert spec.compression == want, name
        chain = [c.__class__.__name__ for c in stored(v).array(name).metadata.codecs[0].codecs]
        assert chain == (["BytesCodec", "ZstdCodec", "Crc32cCodec"] if want == "zstd"
                         else ["BytesCodec", "Crc32cCodec"])
    assert v.manifest.arrays["target"].compression == ("none" if compression == "none" else "zstd")
    got = v.load()
    assert torch.equal(got["logits"], ref["logits"]) and torch.equal(got["target"], data.y)
    batches = list(v.dataset(batch_size=50, seed=2))
    order = torch.cat([b["index"] for b in batches]).argsort()
    assert torch.equal(torch.cat([b["logits"] for b in batches])[order], ref["logits"])
    assert v.verify() == []
    with pytest.raises(featstore.InvalidInput, match="compression must be one of"):
        ComputeOptions(compression="lz4")


def test_single_tensor_output_and_tuple_items(local_store, dask_client):
    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.full((12,), float(i)), i % 3

    lin = torch.nn.Linear(12, 3)
    v = local_store.compute("pairs", model=lin, dataset=Pairs(), input_key=0, keep=[1],
                            outputs={"emb": "float32"}, client=dask_client, options=QUIET)
    got = v.load()
    assert set(got) == {"emb", "field1", "index"}
    with torch.inference_mode():  # a plain Linear on arbitrary floats: equal up to rounding only
        assert_close_across_processes(got["emb"], lin(torch.stack([Pairs()[i][0] for i in range(40)])))
    assert got["field1"].tolist() == [i % 3 for i in range(40)]


def test_same_fingerprint_does_not_run_model_again(local_store, dask_client, tmp_path):
    calls = tmp_path / "calls.txt"
    v1 = compute(local_store, dask_client, model=CountingA(str(calls)))
    first = calls.read_text().count("\n")
    assert first >= 300 // 16  # the probe plus one call per batch
    v2 = compute(local_store, dask_client, model=CountingA(str(calls)))
    assert calls.read_text().count("\n") == first  # not called again
    assert v2.id == v1.id and v2.fingerprint == v1.fingerprint


def test_changing_one_weight_gives_a_new_version(local_store, dask_client):
    a = TinyA()
    v1 = compute(local_store, dask_client, model=a)
    with torch.no_grad():
        a.h.bias[0] += 1e-3
    v2 = compute(local_store, dask_client, model=a)
    assert v2.id != v1.id
    assert [v.id for v in local_store.versions("tiny/train")] == [v1.id, v2.id]
    assert local_store.open("tiny/train").id == v2.id  # newest


def test_dataset_content_and_output_spec_are_in_the_fingerprint(local_store, dask_client):
    v1 = compute(local_store, dask_client)
    v2 = compute(local_store, dask_client, data=VectorData(300, seed=1))
    v3 = compute(local_store, dask_client, outputs={"features": "float32", "logits": "float32"})
    v4 = compute(local_store, dask_client, keep=[])
    assert len({v1.id, v2.id, v3.id, v4.id}) == 4


def test_tags_listing_delete(store, dask_client):
    v1 = compute(store, dask_client)
    v2 = compute(store, dask_client, model=TinyA(seed=1))
    store.tag(v1, "best")
    assert store.open("tiny/train@best") == v1
    assert store.open(f"tiny/train@{v2.id}") == v2
    assert store.tags("tiny/train") == {"best": v1.id}
    store.tag(v2, "best")  # tags move
    assert store.open("tiny/train@best") == v2
    assert store.names() == ["tiny/train"]
    store.delete(v2)
    assert [v.id for v in store.versions("tiny/train")] == [v1.id]
    assert store.tags("tiny/train") == {}  # a tag never points at a deleted version
    with pytest.raises(VersionNotFound):
        store.open(f"tiny/train@{v2.id}")
    with pytest.raises(KeyError):  # VersionNotFound is also a KeyError
        store.open("tiny/train@nope")
    store.tag(v1, "keep")
    store.untag("tiny/train", "keep")
    assert store.tags("tiny/train") == {}


def test_uncommitted_version_is_invisible(local_store, dask_client):
    v = compute(local_store, dask_client)
    manifest = local_store.storage.read_bytes(f"{stored(v).key}/manifest.json")
    local_store.storage.delete(f"{stored(v).key}/manifest.json")  # as if the commit never happened
    assert local_store.versions("tiny/train") == []
    with pytest.raises(VersionNotFound):
        local_store.open("tiny/train")
    with pytest.raises(VersionNotFound):
        local_store.dataset("tiny/train")
    assert local_store.names() == []
    local_store.storage.write_bytes(f"{stored(v).key}/manifest.json", manifest)
    assert local_store.open("tiny/train") == v


def test_embedded_cluster_and_factory_model(local_store):
    v = local_store.compute("factory", model=TinyA, dataset=VectorData(50), outputs=OUTPUTS,
                            samples_per_shard=32, options=QUIET)
    with torch.inference_mode():
        ref = TinyA().eval()(VectorData(50).x)
    assert torch.equal(v.load()["logits"], ref["logits"])


def test_verify_clean_version(local_store, dask_client):
    v = compute(local_store, dask_client)
    assert v.verify() == []


def test_manifest_records_layout_and_libraries(local_store, dask_client):
    v = compute(local_store, dask_client)
    m = v.manifest
    assert m.layout.samples_per_shard == 64 and m.layout.n_samples == 300
    assert {"torch", "zarr", "dask", "featstore"} <= set(m.libraries)
    assert m.fingerprint_parts["outputs"] == OUTPUTS
    assert m.fingerprint_parts["dataset"]["length"] == 300
    shards = stored(v).shard_receipts()
    assert m.shards is None and m.schema_version == 2  # per-shard records live outside the manifest
    assert len(shards) == 5 and all(set(s.digests) == {"features", "logits", "target", "item_digest"} for s in shards)
    assert m.timings["shards_computed"] == 5


def test_xarray_opens_a_committed_version(local_store, dask_client):
    import xarray as xr  # in the test extra
    data, model = VectorData(100), TinyA()
    v = compute(local_store, dask_client, data=data, model=model)
    ds = xr.open_zarr(v.url)  # consolidated at commit: no listing, no warning
    assert ds["logits"].dims == ("sample", "logits_1") and ds.sizes["sample"] == 100
    with torch.inference_mode():
        np.testing.assert_array_equal(ds["logits"].values, model.eval()(data.x)["logits"].numpy())


def test_existing_cluster_by_scheduler_address(local_store, dask_client):
    v = compute(local_store, dask_client.scheduler.address, data=VectorData(40))
    assert len(v) == 40 and v.verify() == []


def test_embedded_cluster_leaves_callers_model_alone(local_store):
    """The CPU default runs the worker in this process: A must be copied, not frozen in place."""
    model = TinyA().train()
    v = local_store.compute("inproc", model=model, dataset=VectorData(40), outputs=OUTPUTS,
                            samples_per_shard=16, options=QUIET)
    assert model.training and all(p.requires_grad for p in model.parameters())
    w = featstore.open_store(local_store.url + "-procs").compute(
        "inproc", model=model, dataset=VectorData(40), outputs=OUTPUTS, samples_per_shard=16,
        options=ComputeOptions(progress=False, processes=True))
    assert torch.equal(v.load()["logits"], w.load()["logits"])


MALLINFO_CHILD = """
import ctypes, sys
import numpy as np
from featstore.compute import _malloc as allocator
class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]

try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version
    libc.mallinfo2.restype = Info
except (OSError, AttributeError) as exc:
    print(exc)
    sys.exit(77)
with allocator.tuned() as active:
    assert active, "the settings did not take"
before = libc.mallinfo2().hblks
block = np.ones(4 << 20, dtype=np.uint8)
assert libc.mallinfo2().hblks == before and block.sum() == 4 << 20, "a fresh mmap for 4 MiB"
"""


def test_allocator_setting_is_scoped_and_changes_no_value(local_store, dask_client):
    from featstore.compute import _malloc as allocator
    glibc = allocator._glibc() is not None  # off glibc (musl, macOS) tuned() does nothing
    with allocator.tuned() as outer:
        with allocator.tuned() as inner:  # concurrent tasks share one setting
            assert outer is inner is glibc and allocator._depth == (2 if glibc else 0)
        assert allocator._depth == (1 if glibc else 0)
    assert allocator._depth == 0
    with allocator.tuned(enabled=False) as active:
        assert active is False and allocator._depth == 0
    data = VectorData(150)
    a = compute(local_store, dask_client, name="tiny/tuned", data=data)
    b = compute(featstore.open_store(local_store.storage.url + "-plain"), dask_client, name="tiny/tuned",
                data=data, options=ComputeOptions(progress=False, tune_allocator=False))
    assert a.id == b.id
    assert [s.digests for s in stored(a).shard_receipts()] == [s.digests for s in stored(b).shard_receipts()]


def test_allocator_leaves_a_warmed_up_heap():
    """Afterwards a 4 MiB block still comes from the heap, as in a warmed-up process: not a fresh
    mmap per allocation (what fixed cold defaults would leave behind). Checked in a fresh child:
    glibc read this process's allocator settings from the environment it inherited, and the
    child gets the cleaned one (conftest.py)."""
    child = subprocess.run([sys.executable, "-c", MALLINFO_CHILD], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[2])
    if child.returncode == 77:
        pytest.skip(f"needs glibc's mallinfo2 (glibc >= 2.33; not musl or macOS): {child.stdout.strip()}")
    assert child.returncode == 0, child.stdout + child.stderr


def test_test_models_compute_exactly():
    """The premise of comparing TinyA's outputs bit for bit across processes (tests/models.py):
    any batch shape and thread count gives the same bits, equal to a float64 computation."""
    data, model = VectorData(300), TinyA()
    threads = torch.get_num_threads()
    with torch.inference_mode():
        ref = model(data.x)
        x64 = data.x.double()
        f64 = torch.relu(x64 @ model.f.weight.double().T + model.f.bias.double())
        assert torch.equal(ref["features"].double(), f64)
        assert torch.equal(ref["logits"].double(), f64 @ model.h.weight.double().T + model.h.bias.double())
        try:
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                for bs in (1, 7, 64, 300):
                    parts = [model(data.x[i:i + bs]) for i in range(0, 300, bs)]
                    for k in ref:
                        assert torch.equal(torch.cat([p[k] for p in parts]), ref[k]), (k, n_threads, bs)
        finally:
            torch.set_num_threads(threads)


def test_a_shard_size_no_chunk_divides_is_refused_naming_sizes_that_work(local_store, dask_client):
    # 4 KiB rows: ~1 MiB inner chunks are 256 rows; 4099 (a prime) has no divisor near that, and
    # as one chunk it would be 16 MiB: refused, never rounded (it used to become 4352).
    with pytest.raises(InvalidInput, match=r"samples_per_shard=4099 .* Use 4096 or 4352"):
        choose_layout(10_000, [4096], 4099, None, 2**26)
    assert choose_layout(10_000, [4096], 499, None, 2**26).chunk_rows == 499  # 2 MiB: one chunk
    # An explicit chunk that does not divide the shard: refused before anything is written.
    with pytest.raises(InvalidInput, match=r"not a multiple of chunk_rows=128.*use 384 or 512"):
        local_store.compute("odd/set", model=TinyA(), dataset=VectorData(64), outputs={"features": "float16"},
                            batch_size=32, samples_per_shard=500, client=dask_client,
                            options=ComputeOptions(progress=False, chunk_rows=128))
    assert local_store.storage.find("") == []


def test_a_taken_dashboard_port_is_said_once_in_featstores_words(local_store, capfd):
    """With port 8787 held by another program, the embedded cluster's dashboard takes another
    port: featstore says so in one line of its own, naming the port, and Dask's raw UserWarning
    (with its site-packages path) does not reach the user."""
    import re
    import socket
    import warnings

    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", 8787))
            holder.listen()
        except OSError:
            pass  # another program holds it already: the case itself
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            local_store.compute("port/set", model=TinyA(), dataset=VectorData(40), outputs={"features": "float32"},
                                options=ComputeOptions(progress=False))
    err = capfd.readouterr().err
    assert [str(w.message) for w in caught if "already in use" in str(w.message)] == []
    said = re.findall(r"featstore: port 8787 is taken .* listens on port (\d+) instead", err)
    assert len(said) == 1, err
    assert f"featstore: Dask dashboard at http://127.0.0.1:{said[0]}/status" in err
