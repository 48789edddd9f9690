"""What a torch DataLoader user tries first meets one line that says what stoker does instead:
DataLoader-only keywords, ``transform=`` given a function, a ``torch.utils.data.Subset`` or a
torch Dataset, a misspelled keyword or option field, ``image_size=(h, w)``; and Dataset and
Loader say what they are in their reprs. Each of these was a bare TypeError, an internal
AttributeError, or a default ``<object at 0x...>`` repr before."""

from __future__ import annotations

import inspect
import pathlib
import re

import numpy as np
import pytest

import stoker
from stoker import CacheOptions, ImageOptions, Loader, ReadOptions, RunOptions, open_dataset
from stoker.cluster.settings import ClusterOptions
from stoker.loader.dataloader_args import INSTEAD, SAME

torch = pytest.importorskip("torch")

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide.md"


@pytest.fixture(scope="module")
def ds(packed_local):
    return open_dataset(packed_local, cache=False)


def test_every_dataloader_argument_is_mapped_in_the_code_and_the_guide():
    # Every argument of the installed torch's DataLoader is either the Loader's own (same name)
    # or refused with an equivalent, and the guide's table has a row for it.
    dataloader = [p for p in inspect.signature(torch.utils.data.DataLoader).parameters if p != "self"]
    loader = set(inspect.signature(Loader.__init__).parameters)
    assert set(SAME) <= loader and not set(INSTEAD) & (loader - {"dataset"})
    assert set(dataloader) <= set(SAME) | set(INSTEAD), set(dataloader) - set(SAME) - set(INSTEAD)
    table = GUIDE.read_text().split("## Coming from torch's DataLoader", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert set(dataloader) <= rows, set(dataloader) - rows


@pytest.mark.parametrize("name", sorted(set(INSTEAD) - {"dataset"}))
def test_a_dataloader_only_keyword_names_the_equivalent(ds, name):
    with pytest.raises(TypeError) as err:
        Loader(ds, 8, num_workers=0, **{name: None})
    msg = str(err.value)
    assert f"Loader() has no {name}= (a torch DataLoader argument): " in msg and "\n" not in msg
    assert "unexpected keyword" not in msg


def test_the_keywords_users_trip_on_say_what_to_use():
    said = {name: stoker.loader.dataloader_args.dataloader_keyword(name) for name in INSTEAD}
    assert "RunOptions(device='cuda')" in said["pin_memory"]
    assert "until close()" in said["persistent_workers"]
    assert "seed" in said["sampler"] and "rank=/world_size=" in said["sampler"]
    assert "decode(fields, rng)" in said["worker_init_fn"]
    assert "collate=" in said["collate_fn"] and "timeout_s" in said["timeout"]


def test_transform_given_a_function_points_to_decode(ds):
    def my_transform(img):
        return img

    with pytest.raises(TypeError, match=r"a function of your own \(my_transform\) goes in decode="):
        Loader(ds, 8, num_workers=0, transform=my_transform)
    with pytest.raises(ValueError, match="transform must be one of"):
        Loader(ds, 8, num_workers=0, transform="training")


def test_a_torch_subset_or_dataset_is_refused_with_what_to_do(ds):
    # It failed deep inside with AttributeError: 'Subset' object has no attribute 'sample_block'.
    sub = torch.utils.data.Subset(ds, range(10))
    with pytest.raises(stoker.NotADatasetError, match=r"not a torch.utils.data.Subset over one \(10 of 120 "):
        Loader(sub, 8, num_workers=0)
    with pytest.raises(TypeError, match=r"pass ds\.subset\(ids, keys or a predicate\) or one of ds\.split"):
        Loader(sub, 8, num_workers=0)

    class Photos(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return i

    with pytest.raises(stoker.NotADatasetError, match=r"packed stoker Dataset .*not a torch Photos: pack the data"):
        Loader(Photos(), 8, num_workers=0)


def test_a_misspelled_keyword_or_field_gets_did_you_mean(ds):
    with pytest.raises(TypeError, match=r"argument 'num_worker' \(did you mean 'num_workers'\?\)"):
        Loader(ds, 8, num_worker=0)
    with pytest.raises(TypeError, match=r"'prefetch_byte' \(did you mean read=ReadOptions\(prefetch_bytes=...\)\?\)"):
        Loader(ds, 8, prefetch_byte=1)
    cases = [
        (ReadOptions, "prefetch_byte", "prefetch_bytes"),
        (ImageOptions, "imagesize", "image_size"),
        (RunOptions, "timeout", "timeout_s"),
        (CacheOptions, "cache_byte", "cache_bytes"),
        (ClusterOptions, "placment", "placement"),
    ]
    for cls, wrong, right in cases:
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got an unexpected keyword argument '{wrong}' "):
            cls(**{wrong: 1})
        with pytest.raises(TypeError, match=rf"\(did you mean '{right}'\?\)"):
            cls(**{wrong: 1})
    with pytest.raises(TypeError, match=r"argument 'zzz'$"):
        ReadOptions(zzz=1)  # nothing near: no suggestion


def test_image_size_as_height_width(ds):
    # stoker.decode.jpeg takes (h, w); ImageOptions took only an int. A square (S, S) is S; a
    # non-square one says why it cannot be (square recipes and slots) and what to use.
    assert ImageOptions(image_size=(64, 64)) == ImageOptions(image_size=64)
    with pytest.raises(ValueError, match=r"image_size=\(224, 160\): .*square images.*decode= with stoker.decode.jpeg"):
        ImageOptions(image_size=(224, 160))
    with pytest.raises(ValueError, match=r"ImageOptions.image_size must be >= 1"):
        ImageOptions(image_size=(0, 0))
    rng = np.random.default_rng(0)
    assert stoker.decode.jpeg(ds.read_fields(0, meta=True), (224, 160), "random", rng=rng).shape == (224, 160, 3)


def test_dataset_and_loader_reprs_say_what_they_are(ds, packed_local):
    assert repr(ds) == (
        f"Dataset({packed_local!r}, version={ds.version[:12]!r}, samples=120, block_bytes='1.0 MiB', cache=None)"
    )
    lo = Loader(ds, 16, num_workers=0, read=ReadOptions(order="uniform"))
    lo.set_epoch(3)
    assert repr(lo) == (
        f"Loader({packed_local!r}, batch_size=16, num_workers=0, epoch=3, rank=0, world_size=1, "
        "read=ReadOptions(order='uniform'))"
    )


def test_the_guides_decode_recipe_runs(ds):
    # docs/guide.md's torchvision-style decode, with a stand-in for torchvision (not a dependency):
    # the same seeding of torch's RNG from rng makes an epoch repeat exactly.
    def augment(img):
        x = img[:, : 2 + int(torch.randint(0, 8, ()))].float() / 255
        return torch.nn.functional.interpolate(x[None], size=(32, 32))[0]

    def decode(fields, rng):
        torch.manual_seed(int(rng.integers(2**63)))
        img = torch.from_numpy(stoker.decode.jpeg(fields, None, None)).permute(2, 0, 1)
        return augment(img), fields["__label__"]

    def epoch():
        with Loader(ds, 40, num_workers=0, decode=decode, seed=1) as lo:
            return [(x.clone(), y.clone()) for x, y in lo]

    first, again = epoch(), epoch()
    assert [x.shape for x, _ in first] == [(40, 3, 32, 32)] * 3
    assert all(torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in zip(first, again, strict=True))
