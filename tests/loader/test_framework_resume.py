"""A checkpoint saved by a training framework's own mechanism resumes the identical stream: on 2
CPU ranks (gloo), a run is checkpointed mid-epoch (and at an epoch's end) and goes on to the end;
a new run started from that checkpoint must deliver, on every rank, exactly the batches of sample
ids the uninterrupted run delivered after it. Checked for torchrun (``loader.state_dict()`` in the
user's checkpoint), HF accelerate (``register_for_checkpointing(loader)`` with ``save_state`` /
``load_state``: rank 0's state loaded on both ranks, also on one rank) and PyTorch Lightning (``ddp``;
``ModelCheckpoint`` and ``trainer.fit(ckpt_path=...)``: Lightning keeps the Loader's state in its
checkpoint because the Loader has ``state_dict``/``load_state_dict``). Ray Train's
``TorchTrainer``, as its documentation recipe goes (``prepare_data_loader`` with its defaults,
``ray.train.report(checkpoint=...)``, ``ray.train.get_checkpoint()``), resumed after a worker
failure and in a new ``fit()`` on one worker: every sample of each epoch trained once. The batches
are the ids the workers decoded (a user ``decode`` that returns ``fields["__id__"]``), written by
each rank to its own file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: a torchrun script: 2 epochs of 8-sample batches, every batch's ids appended to
#: ``ids-<tag>-rank<r>.jsonl``; ``save_at`` steps save a checkpoint (the run goes on), a ``resume``
#: directory is loaded first. argv: packed, work, mode (plain|accelerate), tag, save_at (comma
#: separated global steps, or -), resume (a checkpoint directory, or -).
TORCHRUN = r"""
import json, os, sys
import numpy as np
import torch
import torch.distributed as dist
import stoker

packed, work, mode, tag, save_at, resume = sys.argv[1:7]
save_at = set() if save_at == "-" else {int(s) for s in save_at.split(",")}

def sample_id(fields, rng):
    return np.int64(fields["__id__"])

if mode == "accelerate":
    from accelerate import Accelerator
    acc = Accelerator(cpu=True)
    rank, world_size = acc.process_index, acc.num_processes
else:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
ds = stoker.open_dataset(packed, cache=False)
loader = stoker.Loader(ds, batch_size=8, num_workers=1, seed=5, rank=rank, world_size=world_size,
                       decode=sample_id)
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
if mode == "accelerate":
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.register_for_checkpointing(loader)
step = 0
if resume != "-":
    if mode == "accelerate":
        acc.load_state(resume)
    else:
        ckpt = torch.load(f"{resume}/ckpt.pt", weights_only=False)   # rank 0's, on every rank
        model.load_state_dict(ckpt["model"])
        loader.load_state_dict(ckpt["loader"])
    step = json.load(open(f"{resume}/step.json"))["step"]
out = open(f"{work}/ids-{tag}-rank{rank}.jsonl", "a")
while loader.epoch < 2:
    if step > 64:
        sys.exit(f"rank {rank}: still training at step {step} of 16")
    for ids in loader:
        loss = model(ids.float()[:, None]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        out.write(json.dumps({"step": step, "epoch": loader.epoch - 1, "ids": ids.tolist()}) + "\n")
        out.flush()
        if step in save_at:
            where = f"{work}/ckpt-{step}"
            if mode == "accelerate":
                acc.save_state(where)
            elif rank == 0:
                os.makedirs(where, exist_ok=True)
                torch.save({"model": model.state_dict(), "loader": loader.state_dict()}, f"{where}/ckpt.pt")
            if rank == 0:
                json.dump({"step": step}, open(f"{where}/step.json", "w"))
            dist.barrier()
print(f"rank {rank} done", flush=True)
if mode != "accelerate":
    dist.destroy_process_group()
"""

#: a Lightning script (``strategy="ddp"`` starts rank 1 by running this file again), the same
#: recording from ``training_step``. argv: packed, work, tag, epochs, checkpoint (steps: a
#: ``ModelCheckpoint`` every that many training steps; ``epoch``: the default one, at every
#: epoch's end; ``-``: none), resume (a ``.ckpt`` file, or -).
LIGHTNING = r"""
import json, sys
import numpy as np
import lightning as L
import torch
import stoker

packed, work, tag, epochs, every, resume = sys.argv[1:7]

def sample_id(fields, rng):
    return np.int64(fields["__id__"])

class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, ids, i):
        with open(f"{work}/ids-{tag}-rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": self.global_step + 1, "ids": ids.tolist()}) + "\n")
        return (self.w * ids.float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

callbacks = []
if every == "epoch":
    callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{work}/ckpt", save_top_k=-1, filename="{step}"))
elif every != "-":
    callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
        dirpath=f"{work}/ckpt", every_n_train_steps=int(every), save_top_k=-1, filename="{step}"))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=int(epochs), logger=False,
                    enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
                    enable_model_summary=False)
ds = stoker.open_dataset(packed, cache=False)
loader = stoker.Loader(ds, batch_size=8, num_workers=1, seed=5, rank=trainer.global_rank,
                       world_size=trainer.world_size, decode=sample_id)
trainer.fit(Model(), train_dataloaders=loader, ckpt_path=None if resume == "-" else resume)
print(f"rank {trainer.global_rank} done", flush=True)
loader.close()
if torch.distributed.is_initialized():  # Lightning leaves its gloo group up; its threads at exit can abort
    torch.distributed.destroy_process_group()
"""


#: a Ray Train driver: a one-node Ray on 127.0.0.1, then two ``TorchTrainer.fit()`` of the same run
#: (``RunConfig`` name and storage path: the second resumes the first's last checkpoint). Each
#: worker runs Ray Train's recipe: ``prepare_data_loader`` with its defaults (the wrapper that moves
#: batches to the device, one batch ahead of the loop), rank 0's ``loader.state_dict()`` reported as a
#: checkpoint mid-epoch, ``ray.train.get_checkpoint()`` loaded first. ``PLAN[attempt]`` =
#: (global step of its checkpoint, step at which it fails, or -1) for each start of the training
#: function: 0 (2 workers) checkpoints at step 3 of 8 in epoch 0 and fails at 5; Ray Train restarts
#: it (1, ``FailureConfig(max_failures=1)``), which checkpoints in epoch 1 and stops there (the job
#: ends, as a preempted one does); a new ``fit()`` on 1 worker (2) trains to the end of epoch 1.
#: Every batch's ids go to ``ids-<attempt>-rank<r>.jsonl`` with its step and epoch. argv: packed, work.
RAYTRAIN = r"""
import json, os, sys, tempfile
import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

packed, work = sys.argv[1:3]
PLAN = {0: (3, 5), 1: (8, -1), 2: (-1, -1)}

def sample_id(fields, rng):
    return np.int64(fields["__id__"])

def train(config):
    import stoker
    rank = ray.train.get_context().get_world_rank()
    ds = stoker.open_dataset(packed, cache=False)
    loader = stoker.Loader(ds, batch_size=8, num_workers=1, seed=5, decode=sample_id)  # rank, world: Ray's group
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    attempt = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        loader.load_state_dict(saved["loader"])
        attempt = saved["attempt"] + 1
    save_at, fail_at = PLAN[attempt]
    batches = ray.train.torch.prepare_data_loader(loader)
    step = 0
    with open(f"{work}/ids-{attempt}-rank{rank}.jsonl", "a") as out:
        while loader.epoch < 2:
            for ids in batches:
                loss = model(ids.float()[:, None]).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                out.write(json.dumps({"step": step, "epoch": loader.epoch - 1, "ids": ids.tolist()}) + "\n")
                out.flush()
                if step == save_at:
                    with tempfile.TemporaryDirectory() as d:
                        if rank == 0:
                            state = {"loader": loader.state_dict(), "attempt": attempt}
                            torch.save(state, os.path.join(d, "state.pt"))
                        ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
                    if fail_at == -1:
                        return
                if step == fail_at:
                    raise RuntimeError(f"injected failure at step {step}")

ray.init(address="local", num_cpus=3, object_store_memory=100 << 20, include_dashboard=False,
         _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
run = RunConfig(storage_path=f"{work}/runs", name="resume", failure_config=FailureConfig(max_failures=1))
for workers in (2, 1):
    TorchTrainer(train, torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=workers),
                 run_config=run).fit()
    print(f"fit on {workers} workers done", flush=True)
ray.shutdown()
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out.extend(kids)
        todo.extend(kids)
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every process below it."""
    below = _descendants(pid)
    for target in below:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _launch(cmd: list[str], cwd: Path, timeout_s: float = 240) -> str:
    """Run ``cmd`` in its own session; it must exit by itself with 0 within ``timeout_s`` (else
    its whole group is killed and the test fails)."""
    p = subprocess.Popen(
        cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_tree(p.pid)
        out, err = p.communicate()
        raise AssertionError(
            f"{cmd[:4]} did not exit by itself within {timeout_s:g} s:\n{out}\n{err[-4000:]}"
        ) from None
    finally:
        if p.poll() is None:
            _kill_tree(p.pid)
            p.communicate()
    assert p.returncode == 0, f"{cmd[:4]} failed ({p.returncode}):\n{out}\n{err[-6000:]}"
    return out


def _stream(work: Path, tag: str, rank: int) -> list[tuple[int, list[int]]]:
    """(global step, sample ids) of every batch ``rank`` trained on in run ``tag``."""
    lines = (work / f"ids-{tag}-rank{rank}.jsonl").read_text().splitlines()
    return [(r["step"], r["ids"]) for r in map(json.loads, lines)]


def _check_resumed(work: Path, tag: str, at: int) -> None:
    """Run ``tag``, resumed from the checkpoint of step ``at``, trained each rank on exactly the
    batches the whole run trained it on after step ``at``, in the same order."""
    for rank in (0, 1):
        whole, resumed = _stream(work, "whole", rank), _stream(work, tag, rank)
        assert resumed == [b for b in whole if b[0] > at], (rank, at, whole, resumed)
        assert resumed, (rank, at, "the resumed run trained on nothing")


def _torchrun(script: Path, work: Path, *args: str, ranks: int = 2) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script)]
    return _launch([*cmd, *args], work)


def _check_once_across(work: Path, at: int, tag: str, n: int) -> None:
    """The batches of the whole run's two ranks up to step ``at`` and every batch of run ``tag``
    (resumed from step ``at`` on one rank) hold each of the ``n`` samples once per epoch."""
    seen: dict[int, list[int]] = {0: [], 1: []}
    lines = [ln for r in (0, 1) for ln in (work / f"ids-whole-rank{r}.jsonl").read_text().splitlines()]
    for rec in map(json.loads, lines):
        if rec["step"] <= at:
            seen[rec["epoch"]].extend(rec["ids"])
    for rec in map(json.loads, (work / f"ids-{tag}-rank0.jsonl").read_text().splitlines()):
        seen[rec["epoch"]].extend(rec["ids"])
    for epoch, ids in seen.items():
        assert sorted(ids) == list(range(n)), f"epoch {epoch}: not every sample once ({len(ids)} of {n})"


@pytest.mark.parametrize("mode", ["plain", "accelerate"])
def test_torchrun_checkpoint_resumes_the_same_stream_on_two_ranks(packed_local, tmp_path, mode):
    """120 samples, 8 per batch on 2 ranks: 8 batches per rank per epoch. Saved after step 3
    (mid-epoch 0) and 11 (mid-epoch 1); each resumed in a new torchrun. With accelerate, the
    checkpoint of step 3 (``save_state``: rank 0's Loader state) also resumes on one process, which
    trains the rest of epoch 0 and all of epoch 1: every sample once per epoch across both runs."""
    if mode == "accelerate":
        pytest.importorskip("accelerate")
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN)
    out = _torchrun(script, tmp_path, packed_local, str(tmp_path), mode, "whole", "3,11", "-")
    assert "rank 0 done" in out and "rank 1 done" in out, out
    assert len(_stream(tmp_path, "whole", 0)) == 16
    for at in (3, 11):
        _torchrun(script, tmp_path, packed_local, str(tmp_path), mode, f"from{at}", "-", str(tmp_path / f"ckpt-{at}"))
        _check_resumed(tmp_path, f"from{at}", at)
    if mode == "accelerate":
        args = (packed_local, str(tmp_path), mode, "one3", "-", str(tmp_path / "ckpt-3"))
        assert "rank 0 done" in _torchrun(script, tmp_path, *args, ranks=1)
        _check_once_across(tmp_path, 3, "one3", 120)


def _lightning(script: Path, work: Path, *args: str) -> str:
    return _launch([sys.executable, str(script), *args], work)


def test_lightning_mid_epoch_checkpoint_resumes_the_same_stream_on_two_ranks(packed_local, tmp_path):
    """``ModelCheckpoint(every_n_train_steps=3)`` over 2 epochs of 8 batches per rank: step 9
    (the first batch of epoch 1 done) resumed with ``trainer.fit(ckpt_path=...)``."""
    pytest.importorskip("lightning")
    script = tmp_path / "train_pl.py"
    script.write_text(LIGHTNING)
    out = _lightning(script, tmp_path, packed_local, str(tmp_path), "whole", "2", "3", "-")
    assert "rank 0 done" in out and "rank 1 done" in out, out
    assert len(_stream(tmp_path, "whole", 1)) == 16
    for at in (9,):
        _lightning(
            script, tmp_path, packed_local, str(tmp_path), f"from{at}", "2", "-", str(tmp_path / f"ckpt/step={at}.ckpt")
        )
        _check_resumed(tmp_path, f"from{at}", at)


def test_lightning_end_of_epoch_checkpoint_resumes_the_next_epoch(packed_local, tmp_path):
    """The default ``ModelCheckpoint`` saves at each epoch's end; Lightning then loads no loader
    state on resume (the epoch was finished) and calls ``sampler.set_epoch`` with its epoch: the
    resumed run must train on the next epoch's stream, not replay the one just finished."""
    pytest.importorskip("lightning")
    script = tmp_path / "train_pl.py"
    script.write_text(LIGHTNING)
    _lightning(script, tmp_path, packed_local, str(tmp_path), "whole", "3", "epoch", "-")
    assert len(_stream(tmp_path, "whole", 0)) == 24
    _lightning(script, tmp_path, packed_local, str(tmp_path), "from8", "3", "-", str(tmp_path / "ckpt/step=8.ckpt"))
    _check_resumed(tmp_path, "from8", 8)


def test_ray_train_resumes_after_a_failure_and_in_a_new_fit_on_one_worker_every_sample_once(packed_local, tmp_path):
    """Ray Train's recipe with ``prepare_data_loader``'s defaults (its wrapper takes each batch one
    ahead of the training loop): 120 samples, 8 per batch, 2 workers (8 batches each per epoch).
    Checkpoint at step 3 of epoch 0, a worker failure at step 5 (Ray Train restarts the group from
    the checkpoint; steps 4-5 are lost work), a checkpoint in epoch 1, and a new ``fit()`` of the same
    run on 1 worker to the end. The batches trained up to each checkpoint, and the last run's, hold
    every sample of each epoch exactly once (before: the batch each worker's wrapper held at each
    checkpoint, 16 samples an epoch, was never trained)."""
    pytest.importorskip("ray.train.torch")
    from stoker import open_dataset

    script = tmp_path / "train_ray.py"
    script.write_text(RAYTRAIN)
    out = _launch([sys.executable, str(script), packed_local, str(tmp_path)], tmp_path, timeout_s=480)
    assert "fit on 2 workers done" in out and "fit on 1 workers done" in out, out
    kept = {0: 3, 1: 8, 2: None}  # each start of the training function: the steps up to its checkpoint
    files = sorted(p.name for p in tmp_path.glob("ids-*.jsonl"))
    assert files == [f"ids-{a}-rank{r}.jsonl" for a in (0, 1) for r in (0, 1)] + ["ids-2-rank0.jsonl"]
    trained: dict[int, list[int]] = {0: [], 1: []}
    for name in files:
        attempt = int(name.split("-")[1])
        for rec in map(json.loads, (tmp_path / name).read_text().splitlines()):
            if kept[attempt] is None or rec["step"] <= kept[attempt]:
                trained[rec["epoch"]].extend(rec["ids"])
    n = len(open_dataset(packed_local, cache=False))
    for epoch, ids in trained.items():
        missing, twice = sorted(set(range(n)) - set(ids)), sorted({i for i in ids if ids.count(i) > 1})
        assert (missing, twice, len(ids)) == ([], [], n), f"epoch {epoch}: missing {missing}, twice {twice}"
