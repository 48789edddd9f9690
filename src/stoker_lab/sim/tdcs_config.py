"""The TDCS experiment's parameters (:class:`TdcsConfig`) and their published defaults, kept apart
from the model so that ``stoker simulate --help`` needs no SimPy (the ``sim`` extra)."""

from __future__ import annotations

from dataclasses import dataclass

from .byte_cpu import DEFAULT_NODE_CORES, DEFAULTS, FIELDS

__all__ = ["GPU_MODELS", "IMAGENET_MEAN_BYTES", "IMAGENET_SAMPLES", "V100_RESNET50_RATE", "TdcsConfig"]

#: ImageNet-1k (ILSVRC-2012) train samples (Russakovsky et al., IJCV 2015).
IMAGENET_SAMPLES = 1_281_167
#: Mean ImageNet train JPEG bytes: about 110 KB (the issue's figure; the train tar is ~138 GiB).
IMAGENET_MEAN_BYTES = 110_000
#: ResNet-50 v1.5 training, mixed precision, per V100: 8322 img/s on 8 GPUs of a DGX-1 16GB
#: (NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5 README,
#: "Training performance: NVIDIA DGX-1 16GB (8x V100 16GB)", pytorch-21.03 container) / 8.
V100_RESNET50_RATE = 8322 / 8

#: ``stoker plan --model`` names: samples/s per GPU and where the figure comes from. NVIDIA
#: DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5 README, "Training performance
#: results" (pytorch-21.03 container), 8-GPU throughput / 8.
GPU_MODELS: dict[str, tuple[float, str]] = {
    "resnet50-v100": (
        8322 / 8,
        "NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch README: DGX-1 16GB (8x V100 16GB), "
        "mixed precision, 8 GPUs: 8322 img/s / 8",
    ),
    "resnet50-v100-fp32": (
        2855 / 8,
        "NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch README: DGX-1 16GB (8x V100 16GB), FP32, "
        "8 GPUs: 2855 img/s / 8",
    ),
    "resnet50-a100": (
        16621 / 8,
        "NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch README: DGX A100 (8x A100 80GB), "
        "mixed precision, 8 GPUs: 16621 img/s / 8",
    ),
    "resnet50-a100-tf32": (
        7248 / 8,
        "NVIDIA DeepLearningExamples ResNet-50 v1.5 PyTorch README: DGX A100 (8x A100 80GB), TF32, "
        "8 GPUs: 7248 img/s / 8",
    ),
}


@dataclass
class TdcsConfig:
    """The experiment's parameters (units in the names; sources in :func:`assumptions`)."""

    nodes: int = 16
    gpus_per_node: int = 8
    gpu_rate: float = V100_RESNET50_RATE
    samples: int = IMAGENET_SAMPLES
    mean_sample_bytes: float = IMAGENET_MEAN_BYTES
    sample_sigma: float = 0.5
    shard_bytes: int = 256 << 20
    block_bytes: int = 1 << 20
    store_gbit: float = 10.0
    store_latency_ms: float = 20.0
    store_concurrency: int = 8
    nic_gbit: float = 25.0
    cache_read_GBps: float = 3.0
    cache_fraction: float = 1.0
    decode_cores: int = 40
    decode_rate: float = 688.0
    peer_latency_ms: float = 1.0
    peer_concurrency: int = 8
    chunk_samples: int = 1024
    prefetch_bytes: int = 512 << 20
    epochs: int = 3
    jobs: int = 1
    seed: int = 0
    #: False: a rank reads (one request at a time), decodes and hands each sample to its GPU before
    #: it reads the next (a loader with no read-ahead); True: stoker's Loader, which reads ahead.
    read_ahead: bool = True
    #: The node's CPU cores, which decoding and moving bytes share (:mod:`stoker_lab.sim.byte_cpu`).
    cores_per_node: int = DEFAULT_NODE_CORES[0]
    #: CPU-seconds per GB on each byte path (:data:`stoker_lab.sim.byte_cpu.PATHS`).
    fill_cpu_s_per_GB: float = DEFAULTS["fill"].cpu_s_per_GB
    peer_send_cpu_s_per_GB: float = DEFAULTS["peer_send"].cpu_s_per_GB
    peer_receive_cpu_s_per_GB: float = DEFAULTS["peer_receive"].cpu_s_per_GB
    warm_read_cpu_s_per_GB: float = DEFAULTS["warm_read"].cpu_s_per_GB

    def cpu_costs(self) -> dict[str, float]:
        """CPU-s/GB per byte path (:data:`stoker_lab.sim.byte_cpu.PATHS`), from the fields above."""
        return {p: getattr(self, f) for p, f in FIELDS.items()}
