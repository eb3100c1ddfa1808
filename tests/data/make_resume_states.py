"""Wrote tests/data/states-cbb9962: resume states saved by featstore as it was at commit cbb9962
(before the one reader of issue 43), with the tiny store they refer to, for
tests/test_saved_states.py (states saved by an older featstore must load and resume exactly):

    git worktree add /tmp/old cbb9962
    cd /tmp/old && PYTHONPATH=/tmp/old python /path/to/tests/data/make_resume_states.py OUT

Kept to show how the fixtures were made; the tests only read them. OUT gets:

- ``store/``: three versions (in-process compute, so no Dask): ``fix/a`` (TinyA on 240 samples of
  VectorData, 32-row shards), ``fix/b`` (TinyA seed 1 on 160 other samples, the same arrays) and
  ``fix/t`` (another teacher on fix/a's rows, ``views_of=fix/a``, its logits stored top-3);
- ``states.json``: per case, how the reader was built, the state it saved, the rows yielded before
  the state (``seen``) and the whole uninterrupted epoch read in one go (``epoch``), as
  ``[index, ...]`` (a mixture: ``[[source, index], ...]``);
- ``torchdata-featstore.pt`` / ``torchdata-plain.pt``: a ``featstore.StatefulLoader``'s and a
  plain torchdata ``StatefulDataLoader``'s state, 2 DataLoader workers each (plain dicts: load
  with ``torch.load(..., weights_only=True)``);
- ``lightning/mid.ckpt`` and ``lightning/first.json``: a ``FeatureDataModule`` run (1 device, 2
  persistent workers) checkpointed mid-epoch, and the indices its training steps saw.

Each case is resumed here too, with the featstore that saved it, and checked to read the rest of
the epoch once: the fixture is a state that resumed exactly when it was made.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.getcwd())  # tests.*, from the repository root
import featstore  # noqa: E402
from tests.helpers import QUIET16, TinyA, VectorData, write_version  # noqa: E402

OUT = Path(sys.argv[1]).resolve()


def rows(batch: dict, mixture: bool = False) -> list:
    if mixture:
        return [[int(s), int(i)] for s, i in zip(batch["source"], batch["index"], strict=True)]
    return batch["index"].tolist()


def flat(batches: list, mixture: bool = False) -> list:
    return [r for b in batches for r in rows(b, mixture)]


def key(r) -> object:
    return tuple(r) if isinstance(r, list) else r


def check_once(seen: list, rest: list, epoch: list, what: str) -> None:
    """``seen`` then ``rest`` hold exactly the uninterrupted epoch's rows (as a multiset: a
    mixture may repeat a version's rows on purpose)."""
    got, want = Counter(map(key, seen + rest)), Counter(map(key, epoch))
    assert got == want, f"{what}: resumed epoch differs from the uninterrupted one"
    print(f"{what}: {len(seen)} rows before the state + {len(rest)} after = the epoch's {len(epoch)}")


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    store = featstore.open_store(OUT / "store")
    a = write_version(store, "fix/a", n=240, options=QUIET16)
    b = write_version(store, "fix/b", model=TinyA(seed=1), dataset=VectorData(160, seed=1), options=QUIET16)
    t = write_version(store, "fix/t", model=TinyA(seed=1), dataset=VectorData(240), keep=(),
                      outputs={"logits": "topk:3"}, samples_per_shard=None, views_of=a.ref, options=QUIET16)
    cases: dict[str, dict] = {"versions": {"a": a.ref, "b": b.ref, "t": t.ref}}

    # 1. one version, 2 DataLoader workers, the rank's state after 5 steps
    build = {"batch_size": 16, "seed": 3}
    epoch = flat(DataLoader(store.dataset(a.ref, **build), batch_size=None, num_workers=2))
    ds = store.dataset(a.ref, **build)
    it = iter(DataLoader(ds, batch_size=None, num_workers=2))
    seen = flat([next(it) for _ in range(5)])
    del it
    state = ds.state_dict(batches_seen=5, num_workers=2)
    again = store.dataset(a.ref, **build)
    again.load_state_dict(json.loads(json.dumps(state)))
    check_once(seen, flat(DataLoader(again, batch_size=None, num_workers=2)), epoch, "single")
    cases["single"] = {"ref": a.ref, "build": build, "workers": 2, "state": state, "seen": seen, "epoch": epoch}

    # 2. a 0.7/0.3 mixture of two versions, in the training process, after 4 steps
    build = {"batch_size": 20, "seed": 1}
    mixed = featstore.mix([(a, 0.7), (b, 0.3)], epoch_size=300, **build)
    epoch = flat(list(mixed), True)
    mixed = featstore.mix([(a, 0.7), (b, 0.3)], epoch_size=300, **build)
    it = iter(mixed)
    seen = flat([next(it) for _ in range(4)], True)
    del it
    state = mixed.state_dict()
    again = featstore.mix([(a, 0.7), (b, 0.3)], epoch_size=300, **build)
    again.load_state_dict(json.loads(json.dumps(state)))
    check_once(seen, flat(list(again), True), epoch, "mixture")
    cases["mixture"] = {"streams": [["a", 0.7], ["b", 0.3]], "epoch_size": 300, "build": build, "workers": 0,
                        "state": state, "seen": seen, "epoch": epoch}

    # 3. two teachers on the same rows, after 3 steps
    build = {"batch_size": 16, "seed": 2}
    teachers = {"a": a.ref, "t": t.ref}
    epoch = flat(list(store.dataset(teachers, **build)))
    multi = store.dataset(teachers, **build)
    it = iter(multi)
    seen = flat([next(it) for _ in range(3)])
    del it
    state = multi.state_dict()
    again = store.dataset(teachers, **build)
    again.load_state_dict(json.loads(json.dumps(state)))
    check_once(seen, flat(list(again)), epoch, "multi-teacher")
    cases["multi"] = {"teachers": teachers, "build": build, "workers": 0, "state": state, "seen": seen,
                      "epoch": epoch}

    # 4. torchdata: featstore's StatefulLoader (its state: from before the batch it yielded last)
    # and a plain StatefulDataLoader (per-worker states), 2 workers each
    from torchdata.stateful_dataloader import StatefulDataLoader

    for name, loader_class, taken, seed in (("featstore", featstore.StatefulLoader, 6, 4),
                                            ("plain", StatefulDataLoader, 5, 6)):
        build = {"batch_size": 16, "seed": seed}
        epoch = flat(DataLoader(store.dataset(a.ref, **build), batch_size=None, num_workers=2))
        loader = loader_class(store.dataset(a.ref, **build), batch_size=None, num_workers=2)
        it = iter(loader)
        got = [next(it) for _ in range(taken)]
        state = loader.state_dict()
        del it
        seen = flat(got[:5])  # featstore's loader: the 6th batch is not in its state
        torch.save(state, OUT / f"torchdata-{name}.pt")
        again = loader_class(store.dataset(a.ref, **build), batch_size=None, num_workers=2)
        again.load_state_dict(torch.load(OUT / f"torchdata-{name}.pt", weights_only=True))
        check_once(seen, flat(again), epoch, f"torchdata {name}")
        cases[f"torchdata-{name}"] = {"ref": a.ref, "build": build, "workers": 2, "seen": seen, "epoch": epoch}

    # 5. Lightning: the data module checkpointed after 3 steps, 1 device, 2 persistent workers
    cases["lightning"] = lightning_checkpoint(store, a.ref)
    (OUT / "states.json").write_text(json.dumps(cases, indent=1) + "\n")


def lightning_checkpoint(store: featstore.FeatureStore, ref: str) -> dict:
    import lightning.pytorch as pl

    from featstore.lightning import FeatureDataModule, LoaderOptions
    from tests.lightning_child import Recorder

    steps, build = 3, {"batch_size": 16, "seed": 5}
    out = OUT / "lightning"
    out.mkdir()

    def dm() -> FeatureDataModule:
        return FeatureDataModule(store.url, train=ref, loader=LoaderOptions(num_workers=2, persistent_workers=True),
                                 **build)

    def trainer(**kw) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, num_sanity_val_steps=0, **kw)

    every = pl.callbacks.ModelCheckpoint(dirpath=out, filename="mid", every_n_train_steps=steps, save_top_k=-1,
                                         save_on_train_epoch_end=False)
    first = out / "first"
    first.mkdir()
    trainer(max_steps=steps + 1, callbacks=[every]).fit(Recorder(str(first)), datamodule=dm())
    seen = json.loads((first / "rank0.json").read_text())["0/train"][:steps * build["batch_size"]]
    second = out / "second"
    second.mkdir()
    trainer(max_epochs=1, enable_checkpointing=False).fit(Recorder(str(second)), datamodule=dm(),
                                                        ckpt_path=out / "mid.ckpt")
    rest = json.loads((second / "rank0.json").read_text())["0/train"]
    check_once(seen, rest, list(range(240)), "lightning")
    shutil.rmtree(first)
    shutil.rmtree(second)
    return {"ref": ref, "build": build, "workers": 2, "steps": steps, "seen": seen}


if __name__ == "__main__":
    main()
