"""Every path of each training framework that takes a data loader, run as a user runs it, on 2 CPU
ranks (gloo) with a real tiny model: train, validate (the evaluation loader's pad sample dropped,
every validation sample counted once), checkpoint mid-epoch, resume at 2 ranks and at 1. The
batches are the sample ids the workers decoded (a user ``decode`` returning ``fields["__id__"]``),
each rank writing what it saw to its own file.

- PyTorch Lightning (``strategy="ddp"``): ``fit`` with a validation loader (the sanity check
  included), then ``validate``, ``test`` and ``predict`` (Lightning reads ``batch_sampler``
  directly on these paths); ``fit(ckpt_path=...)`` from a mid-epoch ``ModelCheckpoint`` on 1 rank.
- Hugging Face ``transformers.Trainer`` (torchrun): ``get_train_dataloader`` /
  ``get_eval_dataloader`` return stoker Loaders; :func:`stoker.loader.adapters.loader_checkpoint`
  keeps the Loader's state in the checkpoints, ``ignore_data_skip=True``; the Trainer's
  ``set_epoch`` before a resumed epoch's ``iter()`` keeps the loaded position.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from test_framework_resume import _launch, _torchrun

N_TRAIN, N_VAL = 120, 21  # the val set does not divide by 2 ranks: rank 1 ends with a pad sample

LIGHTNING = r"""
import json, sys
import numpy as np
import lightning as L
import torch
import stoker

packed, val_packed, work, tag, devices, every, resume = sys.argv[1:8]
devices = int(devices)

def sample_id(fields, rng):
    return np.int64(fields["__id__"])

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def _rec(self, kind, ids, i, loader=None):
        row = {"kind": kind, "epoch": self.current_epoch, "step": self.global_step, "ids": ids.tolist()}
        if loader is not None:  # the evaluation loader's pads: after its iter(), epoch - 1 is the one served
            mask = loader.padding_mask(loader.epoch - 1)
            row["pad"] = mask[i * loader.batch_size : i * loader.batch_size + len(ids)].tolist()
        with open(f"{work}/{tag}-rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def training_step(self, ids, i):
        self._rec("train", ids, i)
        return (self.w * ids.float()).sum()

    def validation_step(self, ids, i):
        self._rec("sanity" if self.trainer.sanity_checking else "val", ids, i, val)

    def test_step(self, ids, i):
        self._rec("test", ids, i, val)

    def predict_step(self, ids, i):
        self._rec("predict", ids, i, val)
        return ids

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

callbacks = []
if every != "-":
    callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
        dirpath=f"{work}/ckpt", every_n_train_steps=int(every), save_top_k=-1, filename="{step}"))
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2,
                    logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=2)
rank, world = trainer.global_rank, trainer.world_size
train = stoker.Loader(stoker.open_dataset(packed, cache=False), batch_size=8, num_workers=1, seed=5, rank=rank,
                      world_size=world, decode=sample_id)
val = stoker.Loader(stoker.open_dataset(val_packed, cache=False), batch_size=4, num_workers=0, shuffle=False,
                    transform="eval", rank=rank, world_size=world, decode=sample_id)
model = Model()
trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=None if resume == "-" else resume)
if resume == "-":
    trainer.validate(model, val, verbose=False)
    trainer.test(model, val, verbose=False)
    trainer.predict(model, val)
print(f"rank {rank} done", flush=True)
"""


def _rows(work: Path, tag: str, rank: int) -> list[dict]:
    return [json.loads(line) for line in (work / f"{tag}-rank{rank}.jsonl").read_text().splitlines()]


def _runs(rows: list[dict], kind: str, per_run: int) -> list[list[dict]]:
    """The batches of ``kind`` cut into runs of ``per_run`` batches (one evaluation each)."""
    got = [r for r in rows if r["kind"] == kind]
    assert len(got) % per_run == 0, (kind, len(got))
    return [got[i : i + per_run] for i in range(0, len(got), per_run)]


def _counted_once(ranks: list[list[dict]], label: str, want_pads: int = 1) -> None:
    """One evaluation over every rank: its samples less the pads are each validation sample once,
    and there were ``want_pads`` pads (one on 2 ranks: the dataset does not divide by them)."""
    kept, pads = [], 0
    for batches in ranks:
        for b in batches:
            kept += [i for i, p in zip(b["ids"], b["pad"], strict=True) if not p]
            pads += sum(b["pad"])
    assert sorted(kept) == list(range(N_VAL)) and pads == want_pads, (label, Counter(kept), pads)


@pytest.fixture(scope="module")
def val_packed(tmp_path_factory) -> str:
    """A validation set of 21 images, packed."""
    from stoker.store.pack import pack
    from stoker_lab.sample_data import make_sample_data

    root = tmp_path_factory.mktemp("val")
    make_sample_data(str(root), images=N_VAL, classes=3, seed=1)
    pack(str(root / "train"), str(root / "packed"), progress=False)
    return str(root / "packed")


def test_lightning_fit_with_validation_validate_test_predict_and_resume_on_one_rank(packed_local, val_packed, tmp_path):
    pytest.importorskip("lightning")
    script = tmp_path / "train_pl.py"
    script.write_text(LIGHTNING)
    out = _launch(
        [sys.executable, str(script), packed_local, val_packed, str(tmp_path), "whole", "2", "3", "-"], tmp_path
    )
    assert "rank 0 done" in out and "rank 1 done" in out, out
    rows = [_rows(tmp_path, "whole", r) for r in (0, 1)]
    nb_val = 3  # 11 samples per rank, 4 per batch
    for kind, runs in (("val", 3), ("test", 1), ("predict", 1)):  # val: 2 in fit, then validate()
        per_rank = [_runs(r, kind, nb_val) for r in rows]
        assert [len(p) for p in per_rank] == [runs, runs], kind
        for k in range(runs):
            _counted_once([per_rank[0][k], per_rank[1][k]], f"{kind} {k}")
    assert all(len([r for r in rank if r["kind"] == "sanity"]) == 2 for rank in rows)  # num_sanity_val_steps
    train = [[r for r in rank if r["kind"] == "train"] for rank in rows]
    for epoch in (0, 1):  # every training sample once per epoch over the ranks
        ids = [i for rank in train for r in rank if r["epoch"] == epoch for i in r["ids"]]
        assert sorted(ids) == list(range(N_TRAIN)), epoch

    # resumed on 1 rank from the checkpoint of step 3 (mid-epoch 0): the rest of epoch 0 is every
    # sample the 2 ranks had not trained on, once; then a whole epoch 1
    _launch(
        [
            sys.executable,
            str(script),
            packed_local,
            val_packed,
            str(tmp_path),
            "one",
            "1",
            "-",
            str(tmp_path / "ckpt/step=3.ckpt"),
        ],
        tmp_path,
    )
    done = {i for rank in train for r in rank if r["epoch"] == 0 and r["step"] < 3 for i in r["ids"]}
    resumed = [r for r in _rows(tmp_path, "one", 0) if r["kind"] == "train"]
    rest = [i for r in resumed if r["epoch"] == 0 for i in r["ids"]]
    assert len(done) == 3 * 8 * 2 and sorted(rest) == sorted(set(range(N_TRAIN)) - done)
    assert sorted(i for r in resumed if r["epoch"] == 1 for i in r["ids"]) == list(range(N_TRAIN))
    _counted_once([_runs(_rows(tmp_path, "one", 0), "val", 2 * nb_val)[-1]], "val on 1 rank", want_pads=0)


HF_TRAINER = r"""
import json, os, sys
import numpy as np
import torch
from transformers import Trainer, TrainingArguments
import stoker
from stoker.loader.adapters import loader_checkpoint

packed, val_packed, work, tag, resume = sys.argv[1:6]
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

def sample(fields, rng):
    sid = np.int64(fields["__id__"])
    return {"x": np.float32(sid), "labels": np.int64(fields["__label__"]), "sid": sid}

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, x, labels=None, sid=None):
        logits = self.w.expand(len(x), 4) + 0 * x[:, None]
        row = {"kind": "train" if self.training else "eval", "ids": sid.tolist(), "labels": labels.tolist()}
        with open(f"{work}/{tag}-rank{rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

class PadsMarked:
    # the evaluation Loader's batches, the pad samples' labels set to -100 (the loss and
    # compute_metrics leave them out)
    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        mask, bs = torch.from_numpy(self.loader.padding_mask()), self.loader.batch_size
        for i, batch in enumerate(self.loader):
            pad = mask[i * bs : i * bs + len(batch["labels"])]
            batch["labels"] = torch.where(pad, -100, batch["labels"])
            yield batch

class StokerTrainer(Trainer):
    def get_train_dataloader(self):
        return train

    def get_eval_dataloader(self, eval_dataset=None):
        return PadsMarked(val)

ds, vds = stoker.open_dataset(packed, cache=False), stoker.open_dataset(val_packed, cache=False)
train = stoker.Loader(ds, batch_size=8, num_workers=1, seed=5, rank=rank, world_size=world, decode=sample)
val = stoker.Loader(vds, batch_size=4, num_workers=0, shuffle=False, transform="eval", rank=rank, world_size=world,
                    decode=sample)
args = TrainingArguments(output_dir=f"{work}/out", per_device_train_batch_size=8, per_device_eval_batch_size=4,
                         num_train_epochs=2, learning_rate=0.0, save_strategy="steps", save_steps=3,
                         eval_strategy="epoch", ignore_data_skip=True, use_cpu=True, report_to=[],
                         logging_strategy="no", disable_tqdm=True)
trainer = StokerTrainer(model=Model(), args=args, train_dataset=ds, eval_dataset=vds,
                        callbacks=[loader_checkpoint(train)],
                        compute_metrics=lambda p: {"counted": int((p.label_ids != -100).sum())})
trainer.train(resume_from_checkpoint=None if resume == "-" else resume)
metrics = trainer.evaluate()
if rank == 0:
    json.dump(metrics, open(f"{work}/{tag}-metrics.json", "w"))
print(f"rank {rank} done", flush=True)
"""


def _hf_eval_once(rows: list[list[dict]], nb_val: int) -> None:
    """Each evaluation over the ranks: the samples whose label is not -100 are each validation
    sample once (the pad marked)."""
    runs = [_runs(r, "eval", nb_val) for r in rows]
    assert len({len(r) for r in runs}) == 1 and runs[0]
    for k in range(len(runs[0])):
        kept = [i for r in runs for b in r[k] for i, y in zip(b["ids"], b["labels"], strict=True) if y != -100]
        assert sorted(kept) == list(range(N_VAL)), (k, Counter(kept))


def test_hf_trainer_trains_evaluates_checkpoints_and_resumes_at_two_ranks_and_one(packed_local, val_packed, tmp_path):
    pytest.importorskip("transformers")
    script = tmp_path / "train_hf.py"
    script.write_text(HF_TRAINER)
    args = [packed_local, val_packed, str(tmp_path)]
    out = _torchrun(script, tmp_path, *args, "whole", "-")
    assert "rank 0 done" in out and "rank 1 done" in out, out
    nb_val = 3  # 11 samples per rank, 4 per batch
    whole = [[r for r in _rows(tmp_path, "whole", k) if r["kind"] == "train"] for k in (0, 1)]
    assert [len(w) for w in whole] == [16, 16]  # 2 epochs of 8 batches per rank
    for e in (0, 1):
        assert sorted(i for w in whole for r in w[8 * e : 8 * e + 8] for i in r["ids"]) == list(range(N_TRAIN))
    _hf_eval_once([_rows(tmp_path, "whole", k) for k in (0, 1)], nb_val)
    assert json.loads((tmp_path / "whole-metrics.json").read_text())["eval_counted"] == N_VAL

    ckpt = tmp_path / "out" / "checkpoint-3"
    _torchrun(script, tmp_path, *args, "two", str(ckpt))  # the same batches, rank for rank, after step 3
    for k in (0, 1):
        assert [r for r in _rows(tmp_path, "two", k) if r["kind"] == "train"] == whole[k][3:], k
    _hf_eval_once([_rows(tmp_path, "two", k) for k in (0, 1)], nb_val)

    _launch([sys.executable, str(script), *args, "one", str(ckpt)], tmp_path)  # one rank
    one = [r for r in _rows(tmp_path, "one", 0) if r["kind"] == "train"]
    done = {i for w in whole for r in w[:3] for i in r["ids"]}
    rest = [i for r in one[:-15] for i in r["ids"]]  # epoch 1 on one rank: 15 batches
    assert sorted(rest) == sorted(set(range(N_TRAIN)) - done)
    assert sorted(i for r in one[-15:] for i in r["ids"]) == list(range(N_TRAIN))
    assert json.loads((tmp_path / "one-metrics.json").read_text())["eval_counted"] == N_VAL
