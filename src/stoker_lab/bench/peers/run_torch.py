"""The standard recipe as a benchmark peer: torch DataLoader over the raw ImageFolder tree
on the origin, one GET per image through fsspec, Pillow decode (:mod:`stoker_lab.bench.baseline`).
It has no cache of its own and needs no conversion (the tree is uploaded as it is).

Runs under stoker's own Python (see :mod:`stoker_lab.bench.peers._runner` for the protocol).
"""

import _runner

ABOUT = {
    "packages": ["torch", "fsspec", "s3fs", "pillow"],
    "recipe": "torch.utils.data.DataLoader(shuffle=True, persistent_workers) over a map-style dataset, one fsspec GET "
    "per file, Pillow decode + RandomResizedCrop + flip (torchvision's ImageFolder recipe)",
    "cache": "none: every epoch reads every file from the origin",
    "resume": "none (DataLoader has no state_dict)",
}


def convert(src, out, cfg):
    import shutil

    shutil.copytree(src, out, dirs_exist_ok=True)  # the format is the ImageFolder tree itself


class _Baseline:
    def __init__(self, cfg):
        from stoker_lab.bench.baseline import FsspecImageFolder, make_baseline_loader

        self.ds = FsspecImageFolder(cfg["url"], cfg["storage_options"], seed=cfg["seed"])
        self.loader = make_baseline_loader(self.ds, cfg["batch_size"], cfg["workers"], cfg["seed"])


def build(cfg):
    return _Baseline(cfg)


def epoch(b, e):
    return b.loader  # persistent workers: each iter() is the next epoch


if __name__ == "__main__":
    _runner.main(convert, build, epoch, ABOUT)
