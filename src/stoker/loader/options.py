"""The loader's configuration, in one module. The Loader's less common settings come in three
frozen groups: how samples are read (:class:`ReadOptions`), how images are made
(:class:`ImageOptions`) and how the pipeline runs (:class:`RunOptions`). From them and its common
arguments the Loader builds the frozen records its parts receive: :class:`WorkerConfig` (what the
decode workers need; pickled to each) and :class:`RunConfig` (what one started pipeline is built
from: the groups whole, each part reading the field it needs under its one name).

Each group checks its fields when it is built (ValueError or TypeError naming the field), so a
bad setting fails where it is written, not in a worker. Byte sizes take ints or strings such as
``"512MiB"`` (:func:`stoker.parse_size`) and are kept as ints. ``repr()`` shows only the fields
that differ from the defaults::

    Loader(ds, 256, num_workers=8, read=ReadOptions(prefetch_bytes="2GiB"),
           run=RunOptions(timeout_s=300))

The Loader's old flat keywords (``Loader(ds, 32, prefetch_bytes=...)``) still work for one
release with a DeprecationWarning: :data:`DEPRECATED` maps each to its group and field, and
:func:`loader_kwargs` turns a flat dict of old and new names (a configuration file) into the
Loader's keywords without warnings; :func:`settle` does that at the Loader's door, once.
"""

from __future__ import annotations

import dataclasses
import inspect
import multiprocessing as mp
import numbers
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._names import did_you_mean, suggest_fields
from .._units import parse_size
from ..order import PERMUTATIONS
from .dataloader_args import dataloader_keyword

_CUDA = re.compile(r"cuda(:\d+)?")
#: what a stand-in for the CUDA runtime given as ``RunOptions(device=...)`` must have
#: (:data:`stoker.loader.device.cuda_host.SURFACE`, kept equal by a test)
_RUNTIME_SURFACE = ("device", "register", "unregister", "copy", "event", "handoff", "synchronize")

__all__ = [
    "DEPRECATED",
    "GROUPS",
    "ImageOptions",
    "ReadOptions",
    "RunConfig",
    "RunOptions",
    "WorkerConfig",
    "batch_device",
    "loader_kwargs",
    "order_of",
    "settle",
    "user_stacklevel",
]


def _changed_repr(self) -> str:
    """``Name(field=value, ...)`` with only the fields that differ from their defaults."""
    parts = []
    for f in dataclasses.fields(self):
        value = getattr(self, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            parts.append(f"{f.name}={value!r}")
    return f"{type(self).__name__}({', '.join(parts)})"


def _int(owner: str, name: str, value, least: int) -> int:
    """``value`` as an int >= ``least``; TypeError / ValueError naming ``owner.name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}.{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < least:
        raise ValueError(f"{owner}.{name} must be >= {least}, got {value}")
    return int(value)


def _bool(owner: str, name: str, value) -> bool:
    """``value`` if it is a bool (numpy's too); TypeError naming ``owner.name`` otherwise (a string
    such as "no" is truthy: taking it as True would silently invert the user's intent)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{owner}.{name} must be True or False, got {type(value).__name__} {value!r}")


def _size(owner: str, name: str, value) -> int:
    """A byte size (int or a string such as "64MiB", :func:`stoker.parse_size`); the error names
    ``owner.name``."""
    return parse_size(value, f"{owner}.{name}")


def _choice(owner: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {tuple(allowed)}, got {value!r}")


def _image_side(value) -> int:
    """``ImageOptions.image_size`` as the side S of a square image: an int >= 1, or ``(S, S)``
    (``(height, width)``, as :func:`stoker.decode.jpeg` takes a size). TypeError / ValueError
    naming the field, and for a non-square ``(h, w)`` why and what to use instead."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        h, w = (_int("ImageOptions", "image_size", v, 1) for v in value)
        if h != w:
            raise ValueError(
                f"ImageOptions.image_size=({h}, {w}): the built-in image recipes (transform='train'/'eval', "
                "their batch slots, decode_device and cache_form) make square images (3, S, S), so image_size "
                "is one side S; for (height, width) images pass decode= with stoker.decode.jpeg(fields, "
                f"({h}, {w}), 'random', rng=rng) (docs/guide.md, 'Any kind of sample')"
            )
        return h
    return _int("ImageOptions", "image_size", value, 1)


@suggest_fields
@dataclass(frozen=True, repr=False)
class ReadOptions:
    """In what order samples are read, and how far ahead of the consumer.

    Attributes:
        order: the registered permutation (:data:`stoker.order.PERMUTATIONS`) used when the
            loader shuffles. ``"blockwise"`` (default) shuffles the cache blocks and the samples
            inside windows of ``order_window`` blocks (quasi-random, streams well from a cold
            origin); ``"uniform"`` is a uniform permutation. ValueError for an unknown name.
        order_window: blocks per shuffle window of ``"blockwise"`` (int >= 1, default 16).
        even: how the ranks get equal counts: ``"pad"`` (default, repeat samples) or ``"drop"``
            (:func:`stoker.order.rank_plan`).
        cache_aware_window: if > 0, within each window of that many samples the samples whose
            blocks are cached when the epoch starts come first and the misses follow
            (:func:`stoker.order.cache_aware`; 0 = off, the default). Every sample still comes
            once; ``stats.order_displacement`` is the mean move in positions.
        prefetch_batches: batches in flight at the workers (int >= 1; default None:
            ``max(2, 2 * num_workers)``).
        prefetch_bytes: bytes the block prefetcher runs ahead of the consumer (default 512 MiB).
        staging_bytes: most bytes held in blocks fetched just in time that the node cache did
            not admit (:mod:`stoker.cache.staging`; on the cache's disk; default 64 MiB).
        fetch_concurrency: least number of ranged GETs the prefetcher keeps in flight (int >= 1,
            default 8); it keeps more while latency x bandwidth asks for them
            (:mod:`stoker.loader.prefetch.inflight`).
        prefetch_next_epoch: start the first batches of the next epoch while the last ones of
            this epoch are in flight (default True), so the pipeline never drains at the boundary.

    Byte sizes take ints or strings such as ``"512MiB"``; ValueError / TypeError naming the
    field for a bad one (:func:`stoker.parse_size`).
    """

    order: str = "blockwise"
    order_window: int = 16
    even: str = "pad"
    cache_aware_window: int = 0
    prefetch_batches: int | None = None
    prefetch_bytes: int | str = 512 << 20
    staging_bytes: int | str = 64 << 20
    fetch_concurrency: int = 8
    prefetch_next_epoch: bool = True

    __repr__ = _changed_repr

    def __post_init__(self):
        if self.order not in PERMUTATIONS:
            raise ValueError(f"ReadOptions.order: unknown order {self.order!r}; registered: {sorted(PERMUTATIONS)}")
        _choice("ReadOptions", "even", self.even, ("pad", "drop"))
        set_ = object.__setattr__
        set_(self, "order_window", _int("ReadOptions", "order_window", self.order_window, 1))
        set_(self, "cache_aware_window", _int("ReadOptions", "cache_aware_window", self.cache_aware_window, 0))
        if self.prefetch_batches is not None:
            set_(self, "prefetch_batches", _int("ReadOptions", "prefetch_batches", self.prefetch_batches, 1))
        set_(self, "fetch_concurrency", _int("ReadOptions", "fetch_concurrency", self.fetch_concurrency, 1))
        set_(self, "prefetch_bytes", _size("ReadOptions", "prefetch_bytes", self.prefetch_bytes))
        set_(self, "staging_bytes", _size("ReadOptions", "staging_bytes", self.staging_bytes))
        set_(self, "prefetch_next_epoch", _bool("ReadOptions", "prefetch_next_epoch", self.prefetch_next_epoch))


@suggest_fields
@dataclass(frozen=True, repr=False)
class ImageOptions:
    """How the built-in image path makes its images (none of these apply with the user's
    ``decode``/``collate``: ValueError from the Loader for a non-default one then).

    Attributes:
        image_size: output side S in pixels (int >= 1, default 224); images are uint8 (3, S, S).
            ``(h, w)`` as ``stoker.decode.jpeg`` takes it is accepted when square (kept as S);
            another is a ValueError saying why (the built-in recipes, their batch slots, the GPU
            decoder and the derived forms make square images) and what to do instead.
        exif_orientation: apply the EXIF orientation tag when decoding (default False).
        cache_form: keep each sample's cheaper derived form in a node-local store and decode
            from it from the second epoch (:mod:`stoker.loader.derived`): ``"jpeg"`` (re-encoded,
            shorter side capped at 320 px for 224), ``"jpeg256"``, ``"rgb256"``, ``"rgb"``
            (decoded pixels), ``"raw"`` (off) or ``"auto"`` (measured choice,
            :mod:`stoker.decode.choose`); default None (off). ValueError for an unknown form.
        cache_form_bytes: capacity of that store (default 16 GiB; ints or strings such as "4GiB").
        cache_form_dir: its directory (default None: ``<node cache>/.derived``).
        decode_device: ``"cuda"`` / ``"cuda:N"`` (or a ``torch.device``, kept as its name, or a
            decoder object with ``decode()``, ``transform_batch()`` and ``device``) to decode the
            JPEGs on the GPU in the training process (nvJPEG with a per-sample CPU fallback,
            :mod:`stoker.loader.device.device_decode`); the workers only read and verify bytes, and the
            batches arrive on that device. Default None. ValueError for another device, and
            with ``cache_form`` (derived forms are decoded on the CPU).
    """

    image_size: int = 224
    exif_orientation: bool = False
    cache_form: str | None = None
    cache_form_bytes: int | str = 16 << 30
    cache_form_dir: str | None = None
    decode_device: Any = None

    __repr__ = _changed_repr

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "image_size", _image_side(self.image_size))
        set_(self, "exif_orientation", _bool("ImageOptions", "exif_orientation", self.exif_orientation))
        set_(self, "cache_form_bytes", _size("ImageOptions", "cache_form_bytes", self.cache_form_bytes))
        if self.cache_form not in (None, "auto"):
            from ..decode.forms import parse_form

            try:
                parse_form(self.cache_form, self.image_size)  # ValueError now, not in a worker
            except ValueError as exc:
                raise ValueError(f"ImageOptions.cache_form: {exc}") from None
        dd = self.decode_device
        if dd is None:
            return
        if not isinstance(dd, str) and type(dd).__name__ == "device":
            dd = str(dd)  # a torch.device
            set_(self, "decode_device", dd)
        if isinstance(dd, str):
            if not dd.startswith("cuda"):
                raise ValueError(
                    f"ImageOptions.decode_device must be 'cuda' or 'cuda:N' (or a decoder object), got {dd!r}"
                )
        elif not all(hasattr(dd, a) for a in ("decode", "transform_batch", "device")):
            raise ValueError(
                f"ImageOptions.decode_device must be a CUDA device name or a decoder with decode(), "
                f"transform_batch() and device, got {type(dd).__name__}"
            )
        if self.cache_form is not None:
            raise ValueError(
                "ImageOptions.cache_form (derived forms decoded on the CPU) cannot be used with decode_device"
            )


@suggest_fields
@dataclass(frozen=True, repr=False)
class RunOptions:
    """Where batches go, what a failure does, how the processes start, where metrics are served.

    Attributes:
        device: None / ``"cpu"`` (default: the shared-memory tensors are yielded) or
            ``"cuda[:N]"`` (each batch copied straight from its shared-memory slot, pinned once,
            on a side stream; the slot goes back to the workers when the copy has completed:
            :mod:`stoker.loader.device.transfer`), or an object standing in for the CUDA runtime
            (:class:`stoker.loader.device.cuda_host.CudaRuntime`'s surface: tests without a GPU).
            ValueError for another device; RuntimeError when CUDA is not available. With
            ``ImageOptions.decode_device`` it defaults to that device.
        on_error: ``"raise"`` (default: a sample no decoder reads raises WorkerError naming its
            key) or ``"skip"`` (logged, counted in ``stats.skipped``, the batch is shorter). With
            one rank (``world_size=1``) a batch whose every sample was skipped is not yielded: each
            decodable sample is delivered once, and the epoch has fewer batches than
            ``len(loader)``. With several, under either, every rank yields the same number of
            batches per epoch, ``len(loader)``, so DDP's collectives never wait for a rank that has
            run out: a batch whose every sample
            was skipped is yielded with substitutes decoded in its place, other samples of the
            dataset tried in an order fixed by (seed, epoch, the batch's sample ids), up to the
            batch's planned size, at most ``max(64, 4 x batch size)`` tried
            (:mod:`stoker.loader.workers.padding`). They are counted in ``stats.padded`` /
            ``padded_keys``, not in ``samples`` nor as delivered for ``exactly_once``; a custom
            ``decode`` sees ``fields["__padding__"] = True`` for them (the built-in
            ``(images, labels)`` batch does not mark them). No substitute decoding at all is a
            WorkerError naming the batch: the dataset looks unreadable.
        timeout_s: longest wait in seconds for one batch before WorkerError (never a hang;
            > 0, default 120).
        start_method: multiprocessing start method of the workers (default None: ``fork`` where
            available, ``forkserver`` when the training process runs threads a forked child
            cannot survive, :func:`stoker._procs.pick_start_method`; an explicit ``"fork"`` there
            raises ForkUnsafeError). ``spawn``/``forkserver`` need the usual ``__main__`` guard.
        metrics_port: serve Prometheus metrics of the loader on that port (0: any free one;
            default None: ``$STOKER_METRICS_PORT`` plus ``$LOCAL_RANK`` when set, else none;
            :mod:`stoker.metrics`). Needs the ``metrics`` extra (ImportError without it). A port
            another program holds is logged and the next free one taken (``Loader.metrics_port``
            says which); with every port tried taken the loader runs without metrics, logged.
        epochs: the number of epochs the job runs, epochs ``0 .. epochs - 1`` (int >= 1). Nothing
            of a later epoch is fetched, decoded or logged: the next epoch's first batches
            (``ReadOptions.prefetch_next_epoch``) start only while an epoch before the last one
            drains. Iterating past it still works, without that head start. None (default): no
            bound; the head start of an epoch that never runs is dropped at ``close()``, and the
            samples it skipped (``on_error="skip"``) are logged only when their batch is delivered.
    """

    device: Any = None
    on_error: str = "raise"
    timeout_s: float = 120.0
    start_method: str | None = None
    metrics_port: int | None = None
    epochs: int | None = None

    __repr__ = _changed_repr

    def __post_init__(self):
        _choice("RunOptions", "on_error", self.on_error, ("raise", "skip"))
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, numbers.Real):
            raise TypeError(f"RunOptions.timeout_s must be a number of seconds, got {self.timeout_s!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"RunOptions.timeout_s must be > 0, got {self.timeout_s}")
        if self.start_method is not None and not isinstance(self.start_method, str):
            raise TypeError(f"RunOptions.start_method must be a start method name, got {self.start_method!r}")
        _choice("RunOptions", "start_method", self.start_method, (None, *mp.get_all_start_methods()))
        if self.metrics_port is not None:
            object.__setattr__(self, "metrics_port", _int("RunOptions", "metrics_port", self.metrics_port, 0))
            if self.metrics_port > 65535:
                raise ValueError(f"RunOptions.metrics_port must be a port number in 0..65535, got {self.metrics_port}")
        if self.epochs is not None:
            object.__setattr__(self, "epochs", _int("RunOptions", "epochs", self.epochs, 1))
        if self.device is not None and not isinstance(self.device, str) and type(self.device).__name__ == "device":
            object.__setattr__(self, "device", str(self.device))  # a torch.device
        if isinstance(self.device, str) or self.device is None:
            if self.device not in (None, "cpu") and not _CUDA.fullmatch(self.device):
                # the form only: whether CUDA is there is the Loader's check (options may be built on a
                # CPU-only login node and used on a GPU node)
                raise ValueError(f"RunOptions.device must be None, 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        elif not all(hasattr(self.device, a) for a in _RUNTIME_SURFACE):
            raise ValueError(
                f"RunOptions.device must be None, 'cpu', 'cuda' or 'cuda:N' (or a device runtime with "
                f"{', '.join(_RUNTIME_SURFACE)}), got {self.device!r}"
            )


#: The Loader keyword each option group is passed as, and its class.
GROUPS: dict[str, type] = {"read": ReadOptions, "image": ImageOptions, "run": RunOptions}

#: Old flat Loader keyword -> (group keyword, field) it moved to: every field of the groups but
#: ``RunOptions.epochs`` (which came with the groups: no flat keyword). ``epoch`` moved to no group:
#: ``Loader.set_epoch()`` (group None).
DEPRECATED: dict[str, tuple[str | None, str]] = {
    **{f.name: (g, f.name) for g, cls in GROUPS.items() for f in dataclasses.fields(cls) if f.name != "epochs"},
    "epoch": (None, "epoch"),
}


def where(old: str) -> str:
    """Where the old keyword ``old`` went, in words (for the DeprecationWarning)."""
    group, field = DEPRECATED[old]
    if group is None:
        return "call loader.set_epoch(epoch) before iterating"
    return f"use {group}={GROUPS[group].__name__}({field}=...)"


def regroup(flat: dict, groups: dict, keywords: tuple[str, ...] = ()) -> tuple[dict, int | None]:
    """Move the old flat keywords of ``flat`` into the option groups.

    Args:
        flat: old keyword -> value (every key must be in :data:`DEPRECATED`).
        groups: group keyword -> the option object passed (or None).
        keywords: the Loader's own keywords, suggested for a misspelled one.

    Returns:
        (group keyword -> option object, with the old values set in it; the ``epoch`` given,
        or None).

    Raises:
        TypeError: an old keyword together with its group (say which to keep), a torch
            DataLoader keyword (naming the Loader's equivalent,
            :mod:`stoker.loader.dataloader_args`), or another key that is not an old keyword (as
            Python says for an unexpected keyword argument, with the nearest name: did you mean).
        ValueError: a value the group rejects (names the field).
    """
    out = dict(groups)
    moved: dict[str, dict] = {}
    epoch = None
    for old, value in flat.items():
        if old not in DEPRECATED:
            raise TypeError(dataloader_keyword(old) or unexpected(old, keywords))
        group, field = DEPRECATED[old]
        if group is None:
            epoch = value
            continue
        if groups.get(group) is not None:
            raise TypeError(
                f"{old}= and {group}= were both given: {old} belongs in {group}={GROUPS[group].__name__}({field}=...)"
            )
        moved.setdefault(group, {})[field] = value
    for group, fields in moved.items():
        out[group] = GROUPS[group](**fields)
    return out, epoch


def unexpected(name: str, keywords: tuple[str, ...] = ()) -> str:
    """Python's message for a keyword ``name`` the Loader does not take, with the nearest of
    ``keywords`` (the Loader's own) and the option fields, a field named where it lives
    (``read=ReadOptions(prefetch_bytes=...)``)."""
    hint = did_you_mean(name, [*keywords, *(n for n in DEPRECATED if n != "epoch")])
    near = hint[len(" (did you mean '") : -len("'?)")]
    group, field = DEPRECATED.get(near, (None, ""))
    if group is not None and near not in keywords:
        hint = f" (did you mean {group}={GROUPS[group].__name__}({field}=...)?)"
    return f"Loader.__init__() got an unexpected keyword argument {name!r}{hint}"


def loader_kwargs(flat: dict) -> dict:
    """The :class:`stoker.loader.Loader` keywords for a flat dict that may use the old names
    (a configuration file, a benchmark spec): old names go into their option group, the rest
    pass through. No warning.

    Raises:
        TypeError: an old name together with its group in ``flat``.
    """
    rest = {k: v for k, v in flat.items() if k not in DEPRECATED}
    old = {k: v for k, v in flat.items() if k in DEPRECATED}
    groups, epoch = regroup(old, {g: rest.pop(g, None) for g in GROUPS})
    rest.update({g: o for g, o in groups.items() if o is not None})
    if epoch is not None:
        raise TypeError("epoch is not a Loader argument: call loader.set_epoch(epoch)")
    return rest


def user_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised in the function that calls this one, that names the
    first caller outside stoker: a Loader made by ``ctx.loader(...)`` (stoker.cluster.jobs.job) warns at
    the user's line, not at stoker's."""
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the function that warns
    level = 1
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("stoker."):
        frame = frame.f_back
        level += 1
    return level


def settle(
    read, image, run, deprecated: dict, keywords: tuple[str, ...] = ()
) -> tuple[ReadOptions, ImageOptions, RunOptions, int]:
    """The Loader's option groups at its door, once: the old flat keywords of ``deprecated`` moved
    into their groups (:func:`regroup`; one DeprecationWarning each, ``"<old>= is deprecated;
    <where it went>"``, at the user's line), a group not given (None) made with its defaults.
    ``keywords``: the Loader's own keywords, suggested for a misspelled one.

    Returns:
        (read, image, run, epoch): the groups, and the old ``epoch=`` (0 when not given).

    Raises:
        TypeError: an unknown keyword (a torch DataLoader one names the Loader's equivalent; another
            the nearest name), an old keyword together with its group, or a group that is not of
            its class (names it).
        ValueError: a value a group rejects (names the field).
    """
    epoch = 0
    if deprecated:  # TypeError for an unknown keyword or one given twice, before any warning
        groups, old_epoch = regroup(deprecated, {"read": read, "image": image, "run": run}, keywords)
        level = user_stacklevel()
        for old in deprecated:
            warnings.warn(f"{old}= is deprecated; {where(old)}", DeprecationWarning, stacklevel=level)
        read, image, run = groups["read"], groups["image"], groups["run"]
        epoch = 0 if old_epoch is None else int(old_epoch)
    given = {"read": read, "image": image, "run": run}
    for name, cls in GROUPS.items():
        opt = given[name] = cls() if given[name] is None else given[name]
        if not isinstance(opt, cls):
            article = "an" if cls.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"{name} must be {article} {cls.__name__}, got {type(opt).__name__} {opt!r}")
    return given["read"], given["image"], given["run"], epoch


def order_of(read: ReadOptions, shuffle: bool) -> str:
    """The permutation a loader serves: ``read.order`` when it shuffles, else ``"sequential"``."""
    return read.order if shuffle else "sequential"


def batch_device(run: RunOptions, image: ImageOptions) -> str | None:
    """Where a loader delivers its batches: ``run.device``, else the device ``image.decode_device``
    names (the batches arrive where they are decoded), else None (shared-memory tensors)."""
    if run.device is None and isinstance(image.decode_device, str):
        return image.decode_device
    return run.device


@dataclass(frozen=True)
class WorkerConfig:
    """How a batch's samples are decoded and augmented: built once from the
    :class:`stoker.loader.Loader` arguments and pickled to every worker process with its first task
    queue; being frozen, no process can change it under another.

    Attributes:
        transform: ``"train"`` (RandomResizedCrop + flip, per-sample RNG) or ``"eval"``
            (resize 256 + center crop), see :mod:`stoker.decode.transforms`.
        seed: the loader's seed; each sample's RNG is seeded from (seed, epoch, sample id)
            (:func:`stoker.order.sample_seed`).
        image_size: output side S in pixels; images are uint8 (3, S, S).
        on_error: ``"raise"`` (a sample no decoder reads fails the batch) or ``"skip"``.
        exif_orientation: apply the EXIF orientation tag when decoding.
        batch_size: samples per batch (the slot layout, :mod:`stoker.loader.shm`). The one place
            a loader stores it: ``Loader.batch_size`` reads it here, and every part of the
            pipeline reads it from the WorkerConfig it is handed.
        decode_on: ``"cpu"`` (the workers decode) or ``"device"`` (the workers only read and
            verify bytes; the training process decodes, :mod:`stoker.loader.device.device_decode`).
        derived: the derived-sample cache (:class:`stoker.loader.derived.DerivedCache`) the
            workers read from and fill, or None (set when the pipeline starts, with
            :func:`dataclasses.replace`).
        decode: the user's ``decode(fields, rng) -> sample``, or None (:mod:`stoker.loader.workers.batches`).
        collate: the user's ``collate(samples) -> batch``, or None (:func:`stoker.collate.default`
            when ``decode`` is set).
        substitutes: a batch whose every sample was skipped (``on_error="skip"``) is filled with
            substitutes (:mod:`stoker.loader.workers.padding`), so that every rank yields the same
            number of batches: True for a loader of several ranks; False for one rank, whose such
            batch yields nothing (no sample is decoded twice).
        sample_ids: the packed dataset's sample ids a loader over a subset reads
            (``Dataset.selection``, int64 ascending; substitutes are drawn from them only), or
            None: every sample.
    """

    transform: str
    seed: int
    image_size: int
    on_error: str
    exif_orientation: bool
    batch_size: int
    decode_on: str = "cpu"
    derived: Any = None
    decode: Any = None
    collate: Any = None
    substitutes: bool = True
    sample_ids: Any = field(default=None, compare=False)

    @property
    def generic(self) -> bool:
        """True when the user's decode/collate make the batches (not the built-in image recipes)."""
        return self.decode is not None or self.collate is not None

    def check_picklable(self, start_method: str) -> None:
        """Check that ``decode`` and ``collate`` can be sent to workers started with
        ``start_method`` (``fork`` sends nothing: a child inherits them).

        Raises:
            TypeError: one of them cannot be pickled, or is defined in a ``__main__`` that such a
                worker cannot import (code fed on stdin, ``python -c``, an interactive session, a
                notebook); names the function and says what to do.
        """
        if start_method == "fork":
            return
        import pickle

        from .._procs import main_importable, main_module_name

        for role, fn in (("decode", self.decode), ("collate", self.collate)):
            if fn is None:
                continue
            if getattr(fn, "__module__", None) == "__main__" and not main_importable():
                raise TypeError(
                    f"{role}=__main__.{getattr(fn, '__qualname__', type(fn).__qualname__)} cannot be sent to worker "
                    f"processes started with {start_method!r}: it is defined in {main_module_name()}, which they "
                    "cannot import. Define it in a module file the workers can import, or pass start_method='fork'"
                )
            try:
                pickle.dumps(fn)
            except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
                name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
                raise TypeError(
                    f"{role}={name} cannot be sent to worker processes started with {start_method!r}: it does not "
                    f"pickle ({type(exc).__name__}: {exc}). Define it at the top level of a module the workers can "
                    f"import (not a lambda or a nested function), or pass start_method='fork'"
                ) from exc


@dataclass(frozen=True)
class RunConfig:
    """What one started pipeline (:class:`stoker.loader.pipeline.run.Run`) is built from, made by
    the Loader at each start; the pipeline reads nothing else of the Loader's configuration. The
    option groups travel whole: each part reads the field it needs under the field's one name
    (the prefetch process, ``read.prefetch_bytes``).

    Attributes:
        dataset: the :class:`~stoker.store.dataset.Dataset` read.
        cfg: the :class:`WorkerConfig` the workers get (its ``derived`` set when the pipeline starts).
        num_workers: decode processes (0: decode in the training process).
        read: the Loader's :class:`ReadOptions` (read-ahead, staging, GETs in flight, next epoch's head start).
        image: the Loader's :class:`ImageOptions` (where batches are decoded).
        run: the Loader's :class:`RunOptions` (device, timeout, start method, epochs).
    """

    dataset: Any
    cfg: WorkerConfig
    num_workers: int
    read: ReadOptions
    image: ImageOptions
    run: RunOptions

    @property
    def prefetch_batches(self) -> int:
        """Batches in flight at the workers: ``read.prefetch_batches``, or ``max(2, 2 * num_workers)``
        when that is None."""
        return self.read.prefetch_batches or max(2, 2 * self.num_workers)

    @property
    def device(self) -> str | None:
        """Where batches are delivered (:func:`batch_device`)."""
        return batch_device(self.run, self.image)
