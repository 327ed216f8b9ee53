"""Published large training runs, as typed records, and the GPUs they ran on (chapter 16).

:class:`PublishedRun` holds what a paper states about one run; ``None`` marks what
it does not publish. The rows live in ``data/published_runs.json`` inside the
package and :func:`published_runs` loads them. ``step_seconds`` is derived the same
way for every row: the FLOPs of one step in the source's own convention
(:func:`trainscale.compute.flops_per_token` times the tokens of a step) divided by
the published TFLOP/s per GPU times the GPUs; each row's ``source`` says which
convention and which throughput. The planner (:mod:`trainscale.planner`) turns a
run into its ``Model`` and ``Cluster`` and estimates it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields
from importlib import resources

from trainscale import _checks
from trainscale.checkpointing import RECOMPUTE
from trainscale.software import Software, software

MIB = 2**20
"""Bytes in one MiB, the unit ``nvidia-smi`` reports GPU memory in."""


@dataclass(frozen=True)
class Gpu:
    """One GPU model: dense bf16 peak in FLOP/s, memory in bytes, NVLink bandwidth in
    bytes per second one way per GPU, the GPUs an NVLink node joins, and the memory
    (HBM or GDDR) bandwidth in bytes per second, from the same datasheet, and its
    streaming multiprocessors (SMs), which run a GEMM's tiles in waves.
    ``max_matmul_share`` is the fastest bf16 GEMM measured on it, as a share of
    ``peak_flops`` (``None``: not measured): Stas Bekman's "Maximum Achievable Matmul
    FLOPS" table (stas00/ml-engineering, ``compute/accelerator/README.md``; a search of
    shapes with ``mamf-finder.py``, mean of 100 runs), the same method for every GPU.

    ``attention_share`` is the share of ``peak_flops`` a fused attention kernel sustains
    on it, from the slowest to the fastest published kernel (``None``: none measured).

    ``fp8_peak_flops`` is its dense FP8 peak (``None``: no FP8 tensor cores) and
    ``fp8_max_matmul_share`` the fastest FP8 GEMM measured on it, as a share of that
    peak (``None``: not measured).

    ``peak_flops_low`` is the lowest peak its power limit may hold it to, where no
    datasheet gives its peak (``None``: the datasheet's ``peak_flops`` holds).

    ``memory_bytes`` is the capacity the device reports (``nvidia-smi``'s total,
    in MiB, times 2**20), not the marketing figure: an "80 GB" H100 reports
    81,559 MiB = 79.6 GiB = 85.5e9 bytes, more than 80e9 bytes and less than 80 GiB.
    """

    peak_flops: float
    memory_bytes: float
    nvlink_bandwidth: float
    gpus_per_node: int
    memory_bandwidth: float
    multiprocessors: int
    max_matmul_share: float | None = None
    peak_flops_low: float | None = None
    attention_share: tuple[float, float] | None = None
    fp8_peak_flops: float | None = None
    fp8_max_matmul_share: float | None = None


FLASH_ATTENTION_A100 = (0.50, 0.73)
"""Share of an A100's peak a fused attention kernel sustains: FlashAttention-2 "reaching
50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023, arXiv 2307.08691, abstract;
bib key dao2023flashattention2)."""

FLASH_ATTENTION_H100 = (0.35, 0.75)
"""Share of an H100's peak a fused attention kernel sustains, from FlashAttention-2's "only
35% utilization on the H100 GPU" to FlashAttention-3's "up to 740 TFLOPs/s (75%
utilization)" in 16-bit (Shah et al. 2024, arXiv 2407.08608, abstract; bib key
shah2024flashattention3). cuDNN's fused kernel lies between the two in that paper's
figures."""

FP8_MATMUL_H100 = 1541 / 1979
"""The fastest FP8 GEMM measured on the H100's compute die, as a share of its dense FP8 peak:
1,541 TFLOP/s for 8192 x 8192 x 16384 on an H800 SXM (the H100 SXM's SMs and clocks with
less NVLink), tile-lang's FP8 matmul benchmark (tile-ai/tilelang
benchmark/matmul_fp8/README.md at 6b1faf7; bib key tilelang_fp8_benchmark). One
measurement of one kernel library: FP8 in the planner is less validated than bf16."""

GPUS: dict[str, Gpu] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM, 80 GB): 312 TFLOP/s dense BF16
    # (624 with sparsity); NVLink 3, 600 GB/s both directions together, so 300e9 B/s
    # each way; 8 per DGX/HGX A100 node. Memory: nvidia-smi reports 81,920 MiB
    # (modal-labs/modal-client pull request 2797 lists the totals nvidia-smi prints
    # on its fleet).
    "A100-80GB": Gpu(
        peak_flops=312e12,
        memory_bytes=81_920 * MIB,
        nvlink_bandwidth=300e9,
        gpus_per_node=8,
        memory_bandwidth=2.039e12,  # 2,039 GB/s HBM2e (SXM)
        multiprocessors=108,  # 108 SMs (A100 whitepaper)
        max_matmul_share=271.2 / 312,  # MAMF 271.2 TFLOP/s (torch 2.6, CUDA 12.6)
        attention_share=FLASH_ATTENTION_A100,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOP/s dense BF16 (1,979 with
    # sparsity); NVLink 4, 900 GB/s both directions together, so 450e9 B/s each way;
    # 8 per DGX/HGX H100 node. Memory: nvidia-smi reports 81,559 MiB for "NVIDIA H100
    # 80GB HBM3" (NVIDIA/nccl issue 1264, driver 550.54.15; the same total in
    # modal-labs/modal-client pull request 2797).
    "H100-80GB": Gpu(
        peak_flops=989e12,
        memory_bytes=81_559 * MIB,
        nvlink_bandwidth=450e9,
        gpus_per_node=8,
        memory_bandwidth=3.35e12,  # 3.35 TB/s HBM3 (SXM)
        multiprocessors=132,  # 132 SMs (H100 SXM5)
        max_matmul_share=794.5 / 989,  # MAMF 794.5 TFLOP/s (torch 2.7, CUDA 12.6)
        attention_share=FLASH_ATTENTION_H100,
        fp8_peak_flops=1979e12,  # datasheet: 3,958 TFLOP/s FP8 with sparsity
        fp8_max_matmul_share=FP8_MATMUL_H100,
    ),
    # The H100 of Meta's Grand Teton hosts that torchtitan's December 2024 benchmark ran on
    # (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md): an SXM H100 with 96 GB
    # of HBM2e at 2.4 TB/s and a 500 W power limit, whose "actual peak TFLOPs number is
    # between SXM and NVL" (its footnote 2): peak_flops is the SXM's 989 TFLOP/s, the peak
    # its MFU is quoted against, and peak_flops_low the H100 NVL datasheet's 835 TFLOP/s
    # dense BF16 (1,671 with sparsity). Memory: 96 GB; the nvidia-smi total of this SKU is
    # not published, so it is taken as 96 x 1,024 MiB less the share an 80 GB H100 reports
    # below its 80 x 1,024 MiB (81,559 / 81,920): 97,871 MiB.
    "H100-96GB-500W": Gpu(
        peak_flops=989e12,
        memory_bytes=97_871 * MIB,
        nvlink_bandwidth=450e9,
        gpus_per_node=8,
        memory_bandwidth=2.4e12,  # 2.4 TB/s HBM2e (the benchmark's description)
        multiprocessors=132,  # the H100 SXM5 die
        max_matmul_share=794.5 / 989,  # the H100 SXM's MAMF (measured at 700 W)
        peak_flops_low=835e12,
        attention_share=FLASH_ATTENTION_H100,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB of HBM3e, the H100's
    # 989 TFLOP/s dense BF16 and NVLink 4 (450e9 B/s each way); 8 per HGX H200 node.
    # Memory: nvidia-smi reports 143,771 MiB for "NVIDIA H200" (several public nvidia-smi
    # printouts with drivers 550-580 agree on this total).
    "H200": Gpu(
        peak_flops=989e12,
        memory_bytes=143_771 * MIB,
        nvlink_bandwidth=450e9,
        gpus_per_node=8,
        memory_bandwidth=4.8e12,  # 4.8 TB/s HBM3e
        multiprocessors=132,  # 132 SMs, the H100's die
        max_matmul_share=794.5 / 989,  # the table's H100 row: "H200 is the same"
        attention_share=FLASH_ATTENTION_H100,  # the H100's die and clocks
        fp8_peak_flops=1979e12,  # the H100's: 3,958 TFLOP/s FP8 with sparsity
        fp8_max_matmul_share=FP8_MATMUL_H100,
    ),
    # NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU (4.5 with sparsity);
    # NVLink 5, 1.8 TB/s both directions together, so 900e9 B/s each way; 8 per HGX
    # B200 node; marketed as 180 GB (some sources 192 GB) of HBM3e. Memory: nvidia-smi
    # reports 183,359 MiB for "NVIDIA B200" (NVIDIA/TensorRT-LLM issue 10278, driver
    # 580.95.05).
    "B200": Gpu(
        peak_flops=2250e12,
        memory_bytes=183_359 * MIB,
        nvlink_bandwidth=900e9,
        gpus_per_node=8,
        memory_bandwidth=8e12,  # HGX B200 datasheet: 64 TB/s for 8 GPUs (some list 7.7 TB/s)
        multiprocessors=148,  # 148 SMs (two dies of 74)
        max_matmul_share=1745.0 / 2250,  # MAMF 1,745.0 TFLOP/s (torch 2.7.1, CUDA 12.8)
        fp8_peak_flops=4500e12,  # HGX B200 datasheet: 4.5 PFLOP/s dense FP8 (9 with sparsity)
    ),
    # NVIDIA Ada Lovelace architecture whitepaper (GeForce RTX 4090): 165.2 TFLOP/s
    # dense BF16 tensor with FP32 accumulate (330.4 with sparsity); no NVLink: a PCIe
    # 4.0 x16 slot, about 32e9 B/s each way; counted one per machine. Memory: 24 GB of
    # GDDR6X, nvidia-smi reports 24,564 MiB for "NVIDIA GeForce RTX 4090" (RLinf/RLinf
    # issue 255, driver 550.163.01).
    "RTX 4090": Gpu(
        peak_flops=165.2e12,
        memory_bytes=24_564 * MIB,
        nvlink_bandwidth=32e9,
        gpus_per_node=1,
        memory_bandwidth=1.008e12,  # 1,008 GB/s GDDR6X
        multiprocessors=128,  # 128 SMs (Ada whitepaper)
    ),
}
"""The GPUs published runs name, by :attr:`PublishedRun.gpu`."""


@dataclass(frozen=True)
class PublishedRun:
    """One published training run; ``None`` means the source does not publish it.

    Model: ``params`` (total, embeddings included), ``layers``, ``hidden``, ``heads``,
    ``kv_heads`` (key/value heads; fewer than ``heads`` with grouped-query attention),
    ``ffn_hidden`` (width of the MLP's hidden layer), ``gated_mlp`` (SwiGLU-style, three
    matrices instead of two), ``vocab``, ``seq_len`` (tokens per sequence).
    Hardware: ``gpus`` of type ``gpu`` (a key of :data:`GPUS`),
    ``inter_node_bandwidth`` (bytes per second one GPU sends to another node).
    Layout: ``tp``, ``pp``, ``dp``, ``cp`` (context parallelism), ``virtual_stages``
    (interleaved pipeline chunks per GPU), ``micro_batch`` and ``global_batch`` (in
    sequences), ``zero_stage``, ``recompute`` (one of :data:`trainscale.checkpointing.RECOMPUTE`),
    ``sequence_parallel``. Result: ``step_seconds``, one optimiser step, derived as
    ``source`` says. ``name`` labels the run and ``source`` cites it (with its bib key).
    ``software`` is the stack it ran on (:class:`trainscale.software.Software`; a name of
    :data:`trainscale.software.SOFTWARE` is resolved to its preset).
    """

    name: str
    source: str
    software: Software
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int | None
    ffn_hidden: int | None
    gated_mlp: bool | None
    vocab: int
    seq_len: int
    gpus: int
    gpu: str
    inter_node_bandwidth: float | None
    tp: int
    pp: int
    dp: int
    cp: int | None
    virtual_stages: int | None
    micro_batch: int | None
    global_batch: int
    zero_stage: int | None
    recompute: str | None
    sequence_parallel: bool | None
    step_seconds: float

    def __post_init__(self) -> None:
        for name in ("name", "source"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        object.__setattr__(self, "software", software(self.software))
        required = ("params", "layers", "hidden", "heads", "vocab", "seq_len", "gpus", "tp", "pp")
        for name in (*required, "dp", "global_batch"):
            object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        for name in ("kv_heads", "ffn_hidden", "cp", "virtual_stages", "micro_batch"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        for name in ("gated_mlp", "sequence_parallel"):
            if getattr(self, name) is not None:
                _checks.boolean(name, getattr(self, name))
        _checks.choice("gpu", self.gpu, tuple(GPUS))
        if self.inter_node_bandwidth is not None:
            _checks.positive("inter_node_bandwidth", self.inter_node_bandwidth)
        if self.zero_stage is not None:
            _checks.choice("zero_stage", self.zero_stage, (0, 1, 2, 3))
        if self.recompute is not None:
            _checks.choice("recompute", self.recompute, RECOMPUTE)
        _checks.positive("step_seconds", self.step_seconds)
        if self.tp * self.pp * self.dp * (self.cp or 1) != self.gpus:
            raise ValueError(
                f"tp x pp x dp x cp must equal gpus ({self.gpus}), got "
                f"{self.tp} x {self.pp} x {self.dp} x {self.cp or 1}"
            )

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimiser step: ``global_batch x seq_len``."""
        return self.global_batch * self.seq_len

    @property
    def layer_weights(self) -> int:
        """Weights of one layer's matrices: ``2 h^2`` for the query and output projections,
        ``2 h^2 kv_heads / heads`` for keys and values, and 2 (3 if gated) ``h x ffn_hidden``
        matrices in the MLP. Biases and layer norms are left out."""
        if self.kv_heads is None or self.ffn_hidden is None or self.gated_mlp is None:
            raise ValueError(f"{self.name}: kv_heads, ffn_hidden and gated_mlp are not published")
        h = self.hidden
        attention = 2 * h * h + 2 * h * (h // self.heads) * self.kv_heads
        return attention + (3 if self.gated_mlp else 2) * h * self.ffn_hidden

    @property
    def tied_embeddings(self) -> bool:
        """Whether the output layer reuses the input embedding, read off the parameter count.

        Papers state the total, not the tying. What the layers leave of ``params`` is
        compared with one and with two ``vocab x hidden`` matrices; the nearer wins.
        """
        rest = self.params - self.layers * self.layer_weights
        one = self.vocab * self.hidden
        return abs(rest - one) < abs(rest - 2 * one)


def _row(record: dict) -> PublishedRun:
    names = [f.name for f in fields(PublishedRun)]
    if set(record) != set(names):
        missing, extra = set(names) - set(record), set(record) - set(names)
        raise ValueError(f"a published run needs exactly {names}: missing {missing}, extra {extra}")
    return PublishedRun(**record)


@functools.cache
def published_runs() -> tuple[PublishedRun, ...]:
    """Every published run of ``data/published_runs.json``, in the file's order."""
    text = resources.files("trainscale").joinpath("data/published_runs.json").read_text()
    return tuple(_row(record) for record in json.loads(text))


@dataclass(frozen=True)
class CalculonRow:
    """One row of Calculon's own validation (``data/calculon_validation.json``): a published
    run's name, the step time its source measured and the one Calculon computes, seconds."""

    run: str
    measured_seconds: float
    calculon_seconds: float


@functools.cache
def calculon_validation() -> tuple[str, tuple[CalculonRow, ...]]:
    """``(source, rows)``: Calculon's end-to-end validation against Korthikanti et al.'s
    Table 5 (Isaev et al. 2023), as its own script prints it, with where and how it was run;
    each row names one of :func:`published_runs`."""
    text = resources.files("trainscale").joinpath("data/calculon_validation.json").read_text()
    data = json.loads(text)
    return data["source"], tuple(CalculonRow(**row) for row in data["rows"])
