"""The operator's planner behind `kvtier size`: weights, KV, HBM headroom, tier capacities, reload bandwidth.

Pure functions over plain data, exact integer/`Fraction` arithmetic (bytes are rounded up once, at
the end). The model it plans with:

- A **workload** is how many sequences each model replica (one tensor-parallel group) holds KV for,
  and their context lengths: given lengths (each counted `concurrency` times), a distribution of
  quantiles, or the input lengths of a request trace (`concurrency` sequences drawn from it).
- **HBM per GPU** = weights / TP + a runtime reserve (a fraction of HBM, default 10% as in vLLM's
  `gpu_memory_utilization=0.9`, for activations, CUDA context and fragmentation) + KV. Under TP a
  GPU keeps `num_kv_heads / TP` KV heads, at least one (heads are replicated when TP > KV heads), and
  the whole MLA latent (replicated on every rank).
- KV that does not fit **overflows** down the tiers, one copy per block (exclusive placement):
  DRAM (per server), then the memory pool (shared by the cluster), then SSD (per server). A tier
  given no capacity takes all that reaches it, which sizes it; KV past the last capacity given is
  `unplaced` (it will be recomputed). Lower tiers store every layer for every token.
- **Reload**: to bring a context back within the TTFT target, each GPU must move its share of the
  context's KV over its own link (one PCIe link, NIC and set of drives per GPU) in that time.

This module holds workloads and the KV report; `kvtier.sizing.capacity` the plan against a GPU and tiers.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvtier.errors import ConfigError, GeometryError
from kvtier.model.geometry import LayerKind, ModelGeometry
from kvtier.units import check_number

DEFAULT_RESERVE_FRACTION = Fraction(1, 10)
DEFAULT_TTFT_TARGET_S = Fraction(1)
TRACE_QUANTILES = (("p50", Fraction(1, 2)), ("p90", Fraction(9, 10)), ("p99", Fraction(99, 100)), ("max", Fraction(1)))


class WeightDtype(enum.Enum):
    """The element type of the weights; `bits` is what sizing multiplies by (quantization scales not counted)."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    FP4 = "fp4"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8}.get(self.value, 4)

    @classmethod
    def parse(cls, value: WeightDtype | str) -> WeightDtype:
        """Reads `fp16`, `bfloat16`, `torch.float32`, `int4`, `nvfp4`, ... case-insensitively.

        Raises:
            ConfigError: unknown name; the message lists the valid ones.
        """
        if isinstance(value, WeightDtype):
            return value
        key = str(value).strip().lower().removeprefix("torch.")
        aliases = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "nvfp4": "fp4",
                   "mxfp4": "fp4", "float8_e4m3fn": "fp8", "fp8_e4m3": "fp8"}  # fmt: skip
        try:
            return cls(aliases.get(key, key))
        except ValueError:
            valid = ", ".join(d.value for d in cls)
            raise ConfigError(f"unknown weight_dtype {value!r}; valid: {valid}") from None

    @classmethod
    def of_config(cls, cfg: dict[str, Any]) -> WeightDtype:
        """The dtype a checkpoint is served in: its quantization, else `torch_dtype` (fp32 served as bf16)."""
        quant = cfg.get("quantization_config") or {}
        if quant.get("quant_method") == "fp8":
            return cls.FP8
        if quant.get("quant_method") == "mxfp4":  # gpt-oss: the experts, nearly all weights; the rest is bf16
            return cls.FP4
        if quant.get("bits") in (4, 8):
            return cls.INT4 if quant["bits"] == 4 else cls.INT8
        try:
            dtype = cls.parse(cfg.get("torch_dtype") or cfg.get("dtype") or "fp16")
        except ConfigError:
            return cls.FP16
        return cls.BF16 if dtype is cls.FP32 else dtype


# ---------------------------------------------------------------------------------------------
# workload


@dataclass(frozen=True)
class Workload:
    """The sequences one model replica holds KV for.

    Attributes:
        concurrency: the `--concurrency` it was built from.
        shares: (context tokens, sequences per replica) classes; shares sum to the sequence count.
        points: (label, tokens) context lengths to report one by one; label "" for a plain length.
        source: "contexts", "distribution" or "trace".
    """

    concurrency: int
    shares: tuple[tuple[int, Fraction], ...]
    points: tuple[tuple[str, int], ...]
    source: str

    @classmethod
    def from_contexts(cls, contexts_tokens: Sequence[int], concurrency: int) -> Workload:
        """`concurrency` sequences at each length.

        Raises:
            ConfigError: no length, or a length or the concurrency is not positive.
        """
        if not contexts_tokens:
            raise ConfigError("context: give at least one context length")
        for value in contexts_tokens:
            check_positive("context", value)
        check_positive("concurrency", concurrency)
        shares = tuple((n, Fraction(concurrency)) for n in contexts_tokens)
        return cls(concurrency, shares, tuple(("", n) for n in contexts_tokens), "contexts")

    @classmethod
    def from_quantiles(cls, quantiles: dict[str, int], concurrency: int) -> Workload:
        """`concurrency` sequences whose lengths follow a quantile function, linear between the points.

        Args:
            quantiles: `{"min": 0, "p50": 4096, "p90": 32768, "max": 131072}`; `max` is required,
                `min` defaults to 0; `pNN` takes any 0 < NN < 100 (`p99.9` too).
            concurrency: sequences per replica.

        Returns:
            One class per segment, at its midpoint (rounded up), weighted by its probability: the
            exact mean for full-attention models, a slight over-estimate under sliding windows.

        Raises:
            ConfigError: no max, an unknown key, or lengths that decrease with the quantile.
        """
        check_positive("concurrency", concurrency)
        points = sorted((_quantile("context_dist", key), key, n) for key, n in quantiles.items())
        if not points or points[-1][0] != 1:
            raise ConfigError("context_dist: give max= (the longest context), e.g. p50=4k,p90=32k,max=128k")
        for _, key, n in points:
            (check_non_negative if key == "min" else check_positive)(f"context_dist {key}", n)
        if points[0][0] != 0:
            points.insert(0, (Fraction(0), "min", 0))
        shares = []
        for (q0, k0, t0), (q1, k1, t1) in itertools.pairwise(points):
            if q0 == q1 or t1 < t0:
                raise ConfigError(f"context_dist: {k1}={t1:,} must be longer than {k0}={t0:,}, and each key once")
            shares.append((math.ceil(Fraction(t0 + t1, 2)), concurrency * (q1 - q0)))
        labels = tuple((key, n) for q, key, n in points if q > 0)
        return cls(concurrency, tuple(shares), labels, "distribution")

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], concurrency: int) -> Workload:
        """`concurrency` sequences drawn from observed lengths (a trace's input lengths).

        Raises:
            ConfigError: no lengths, or a length or the concurrency is not positive.
        """
        check_positive("concurrency", concurrency)
        counts = Counter(lengths)
        for n in counts:
            check_positive("trace input_length", n)
        total = sum(counts.values())
        if not total:
            raise ConfigError("trace: no input lengths")
        ordered = sorted(counts.elements())
        points = tuple((label, ordered[math.ceil(q * total) - 1]) for label, q in TRACE_QUANTILES)
        shares = tuple((n, Fraction(concurrency * c, total)) for n, c in sorted(counts.items()))
        return cls(concurrency, shares, points, "trace")

    @property
    def num_sequences(self) -> Fraction:
        return sum((s for _, s in self.shares), Fraction(0))

    @property
    def max_tokens(self) -> int:
        return max(max(n for _, n in self.points), max(n for n, _ in self.shares))

    def total(self, per_sequence: Any) -> Fraction:
        """Σ share × per_sequence(tokens), exactly."""
        return sum((s * per_sequence(n) for n, s in self.shares), Fraction(0))


def _quantile(field: str, key: str) -> Fraction:
    if key in ("min", "p0"):
        return Fraction(0)
    if key in ("max", "p100"):
        return Fraction(1)
    try:
        q = Fraction(key.removeprefix("p")) / 100 if key.startswith("p") else None
    except ValueError:
        q = None
    if q is None or not 0 < q < 1:
        raise ConfigError(f"{field}: unknown key {key!r}; use min, p50, p90, p99.9, max, ...")
    return q


# ---------------------------------------------------------------------------------------------
# the KV report `kvtier size` has always printed


def size_report(
    geometry: ModelGeometry, contexts_tokens: Sequence[int], concurrency: int, block_tokens: int
) -> dict[str, Any]:
    """KV-cache bytes for `concurrency` sequences at each context length (`workload_report` of them).

    Raises:
        ConfigError: no context is given, or a context, concurrency or block_tokens is not positive.
    """
    return workload_report(geometry, Workload.from_contexts(contexts_tokens, concurrency), block_tokens)


def workload_report(geometry: ModelGeometry, workload: Workload, block_tokens: int) -> dict[str, Any]:
    """KV-cache bytes of a workload on one replica.

    Returns:
        A JSON-ready dict: model facts, `kv_bytes_per_token` (every layer counting every token) and
        its split by layer kind, `block_bytes`, one entry per reported context under `contexts`
        (`kv_bytes_per_sequence` honours sliding windows; `block_bytes_per_sequence` is what the
        tiers store for the sequence's full blocks; `kv_bytes_total` is `concurrency` of them), and
        `kv_bytes_total` / `block_bytes_total` over the whole workload (for given lengths: the sum
        of the entries; for a distribution or trace: the expectation), plus `workload`.

    Raises:
        ConfigError: block_tokens is not positive.
    """
    check_positive("block_tokens", block_tokens)
    block_bytes = geometry.block_bytes(block_tokens)
    contexts = [_context_entry(geometry, label, n, workload.concurrency, block_tokens) for label, n in workload.points]
    return {
        **_model_facts(geometry),
        "kv_bytes_per_token": geometry.kv_bytes_per_token(),
        "kv_bytes_per_token_by_kind": {k.value: n for k, n in geometry.kv_bytes_per_token_by_kind().items()},
        "block_tokens": block_tokens,
        "block_bytes": block_bytes,
        "concurrency": workload.concurrency,
        "contexts": contexts,
        "kv_bytes_total": math.ceil(workload.total(geometry.kv_bytes_for_tokens)),
        "block_bytes_total": math.ceil(workload.total(lambda n: n // block_tokens * block_bytes)),
        "workload": {
            "source": workload.source,
            "num_sequences_per_replica": float(workload.num_sequences),
            "mean_context_tokens": float(workload.total(lambda n: n) / workload.num_sequences),
            "max_context_tokens": workload.max_tokens,
        },
    }


def _model_facts(geometry: ModelGeometry) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "model": geometry.name,
        "kv_dtype": geometry.kv_dtype.value,
        "kv_dtype_bytes": geometry.kv_dtype.bytes,
        "num_layers": geometry.num_layers,
        "num_layers_by_kind": {k.value: n for k, n in geometry.num_layers_by_kind().items()},
        "num_attention_heads": geometry.num_attention_heads,
        "num_kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
    }
    if geometry.kv_lora_rank:
        facts |= {"kv_lora_rank": geometry.kv_lora_rank, "qk_rope_head_dim": geometry.qk_rope_head_dim}
    windows = sorted({s.window_tokens for s in geometry.layers if s.window_tokens is not None})
    if windows:
        facts["sliding_window_tokens"] = windows
    return facts


def _context_entry(geometry: ModelGeometry, label: str, tokens: int, concurrency: int, block_tokens: int) -> dict:
    per_sequence_bytes = geometry.kv_bytes_for_tokens(tokens)
    num_blocks = tokens // block_tokens  # a partial last block is never cached
    block_bytes = num_blocks * geometry.block_bytes(block_tokens)
    entry = {"label": label} if label else {}
    return entry | {
        "context_tokens": tokens,
        "kv_bytes_per_sequence": per_sequence_bytes,
        "kv_bytes_total": per_sequence_bytes * concurrency,
        "num_blocks_per_sequence": num_blocks,
        "block_bytes_per_sequence": block_bytes,
        "block_bytes_total": block_bytes * concurrency,
    }


# ---------------------------------------------------------------------------------------------
# validation


def check_positive(field: str, value: Any) -> None:
    """Raises ConfigError naming `field` unless `value` is an integer > 0."""
    check_number(value, field, integral=True, positive=True)


def check_non_negative(field: str, value: Any) -> None:
    """Raises ConfigError naming `field` unless `value` is an integer >= 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{field} must be a non-negative integer, got {value!r}")


def kv_share_per_gpu(geometry: ModelGeometry, tensor_parallel: int) -> Fraction:
    """The fraction of a sequence's KV each GPU of a TP group keeps.

    Raises:
        GeometryError: TP does not divide the attention heads, or KV heads and TP do not divide
            one another (engines shard or replicate whole KV heads).
    """
    check_positive("tensor_parallel", tensor_parallel)
    heads, kv_heads, name = geometry.num_attention_heads, geometry.num_kv_heads, geometry.name
    if heads % tensor_parallel:
        raise GeometryError(f"{name}: tensor-parallel degree {tensor_parallel} does not divide "
                            f"its {heads} attention heads")  # fmt: skip
    if any(spec.kind is LayerKind.MLA for spec in geometry.layers):
        return Fraction(1)  # every rank keeps the whole latent
    if kv_heads % tensor_parallel and tensor_parallel % kv_heads:
        raise GeometryError(f"{name}: tensor-parallel degree {tensor_parallel} and its {kv_heads} KV heads "
                            "do not divide one another")  # fmt: skip
    return Fraction(max(kv_heads // tensor_parallel, 1), kv_heads)
