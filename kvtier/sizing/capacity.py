"""The capacity plan behind `kvtier size --gpu`: HBM fit, overflow to DRAM / pool / SSD, reload fabrics.

The model it plans with is described in `kvtier.sizing.planner` (workloads, HBM per GPU, overflow, reload);
this module holds the plan itself and its verdict lines. Pure functions over plain data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from kvtier.errors import ConfigError, GeometryError
from kvtier.model.geometry import ModelGeometry
from kvtier.sizing.hardware import FABRICS, GPU
from kvtier.units import format_bytes, format_decimal, format_params, format_rate
from kvtier.sizing.planner import (
    DEFAULT_RESERVE_FRACTION,
    DEFAULT_TTFT_TARGET_S,
    WeightDtype,
    Workload,
    check_non_negative,
    check_positive,
    kv_share_per_gpu,
    workload_report,
)

# ---------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner needs besides the workload report. Capacities of None are sized for you.

    Attributes:
        weight_params: parameters of the model; None when unknown (no HBM plan then).
        gpu: the GPU; None plans no HBM or tiers (reload bandwidth only).
        gpus_per_server: GPUs in one server; a multiple of `tensor_parallel`.
        reserve_fraction: share of HBM held back for activations, CUDA context and fragmentation.
        dram_bytes_per_server / pool_bytes / ssd_bytes_per_server: KV capacity of each lower tier;
            the pool's is for the whole cluster.
        ttft_target_s: the time a context's KV may take to reload.
    """

    weight_params: int | None
    weight_dtype: WeightDtype
    gpu: GPU | None
    tensor_parallel: int = 1
    gpus_per_server: int = 1
    num_servers: int = 1
    reserve_fraction: Fraction = DEFAULT_RESERVE_FRACTION
    dram_bytes_per_server: int | None = None
    pool_bytes: int | None = None
    ssd_bytes_per_server: int | None = None
    ttft_target_s: Fraction = DEFAULT_TTFT_TARGET_S

    def __post_init__(self) -> None:
        for field, flag in (("tensor_parallel", "--tp"), ("gpus_per_server", "--gpus-per-server"),
                            ("num_servers", "--servers")):  # fmt: skip
            check_positive(f"{field} ({flag})", getattr(self, field))
        if self.gpus_per_server % self.tensor_parallel:
            raise ConfigError(f"gpus_per_server ({self.gpus_per_server}) must be a multiple of tensor_parallel "
                              f"({self.tensor_parallel}): a TP group stays inside one server")  # fmt: skip
        if self.weight_params is not None:
            check_positive("weight_params", self.weight_params)
        if self.gpu is not None:
            check_positive("hbm_bytes", self.gpu.hbm_bytes)
        if not 0 <= self.reserve_fraction < 1:
            raise ConfigError(f"reserve must be a fraction in [0, 1), got {float(self.reserve_fraction)}")
        for field in ("dram_bytes_per_server", "pool_bytes", "ssd_bytes_per_server"):
            if getattr(self, field) is not None:
                check_non_negative(field, getattr(self, field))
        if self.ttft_target_s <= 0:
            raise ConfigError(f"ttft_target must be positive, got {float(self.ttft_target_s)} s")


def plan(geometry: ModelGeometry, workload: Workload, block_tokens: int, inputs: PlanInputs) -> dict[str, Any]:
    """The full plan: `workload_report` plus `weights`, `parallel`, `hbm`, `tiers`, `reload`, `verdict`.

    `hbm` and `tiers` appear only with a GPU and a weight count; they are per GPU and per server
    / cluster respectively (see the module docstring for the model).

    Raises:
        ConfigError / GeometryError: bad block size, or a TP degree that does not fit the heads.
    """
    report = workload_report(geometry, workload, block_tokens)
    share = kv_share_per_gpu(geometry, inputs.tensor_parallel)
    report["parallel"] = _parallel(inputs, share)
    if inputs.weight_params is not None:
        report["weights"] = _weights(inputs)
    if inputs.gpu is not None and inputs.weight_params is not None:
        report["hbm"] = _hbm(geometry, workload, inputs, share)
        report["tiers"] = _tiers(geometry, workload, inputs, report["hbm"])
    report["reload"] = _reload(geometry, workload, inputs, share)
    report["verdict"] = _verdict(report)
    return report


def _parallel(inputs: PlanInputs, share: Fraction) -> dict[str, Any]:
    replicas = inputs.gpus_per_server // inputs.tensor_parallel
    return {
        "tensor_parallel": inputs.tensor_parallel, "gpus_per_server": inputs.gpus_per_server,
        "num_servers": inputs.num_servers, "replicas_per_server": replicas,
        "num_replicas": replicas * inputs.num_servers,
        "kv_share_per_gpu": float(share),
        "kv_replication": int(share * inputs.tensor_parallel),  # copies of each KV byte in a TP group
    }  # fmt: skip


def _weight_bytes(inputs: PlanInputs) -> int:
    return math.ceil(Fraction(inputs.weight_params * inputs.weight_dtype.bits, 8))


def _weights(inputs: PlanInputs) -> dict[str, Any]:
    total = _weight_bytes(inputs)
    return {
        "num_params": inputs.weight_params, "dtype": inputs.weight_dtype.value, "bits": inputs.weight_dtype.bits,
        "bytes": total, "bytes_per_gpu": math.ceil(Fraction(total, inputs.tensor_parallel)),
    }  # fmt: skip


def _hbm_fit(geometry: ModelGeometry, workload: Workload, inputs: PlanInputs, tensor_parallel: int) -> dict:
    """Per-GPU HBM budget at one TP degree."""
    share = kv_share_per_gpu(geometry, tensor_parallel)
    hbm = inputs.gpu.hbm_bytes
    weights = math.ceil(Fraction(_weight_bytes(inputs), tensor_parallel))
    reserve = math.floor(hbm * inputs.reserve_fraction)
    room = hbm - weights - reserve
    demand = math.ceil(share * workload.total(geometry.kv_bytes_for_tokens))
    return {"hbm": hbm, "weights": weights, "reserve": reserve, "room": room, "demand": demand}


def _hbm(geometry: ModelGeometry, workload: Workload, inputs: PlanInputs, share: Fraction) -> dict[str, Any]:
    fit = _hbm_fit(geometry, workload, inputs, inputs.tensor_parallel)
    room, demand = fit["room"], fit["demand"]
    in_hbm = max(0, min(room, demand))
    longest = math.ceil(share * geometry.kv_bytes_for_tokens(workload.max_tokens))
    return {
        "gpu": inputs.gpu.name, "tensor_parallel": inputs.tensor_parallel, "hbm_bytes": fit["hbm"],
        "weights_bytes": fit["weights"], "reserve_fraction": float(inputs.reserve_fraction),
        "reserve_bytes": fit["reserve"],
        "kv_room_bytes": room, "kv_demand_bytes": demand, "kv_bytes": in_hbm, "overflow_bytes": demand - in_hbm,
        "needed_bytes": fit["weights"] + fit["reserve"] + demand, "free_bytes": max(0, room - demand),
        "weights_fit": room >= 0, "fits": room >= demand,
        "longest_context_fits": room >= longest,
        "max_sequences_at_longest_context": max(room, 0) // longest if longest else 0,
        "min_tensor_parallel_to_fit": _min_tp_to_fit(geometry, workload, inputs),
    }  # fmt: skip


def _min_tp_to_fit(geometry: ModelGeometry, workload: Workload, inputs: PlanInputs) -> int | None:
    """The smallest TP in 1, 2, 4, 8 that the heads allow and at which weights, reserve and KV fit."""
    for tp in (1, 2, 4, 8):
        try:
            fit = _hbm_fit(geometry, workload, inputs, tp)
        except GeometryError:
            continue
        if fit["room"] >= fit["demand"]:
            return tp
    return None


def _tiers(geometry: ModelGeometry, workload: Workload, inputs: PlanInputs, hbm: dict) -> dict[str, Any]:
    """Cascades each replica's overflow down DRAM -> pool -> SSD, in stored (every-token) bytes."""
    stored = workload.total(lambda n: n * geometry.kv_bytes_per_token())
    demand, overflow_gpu = hbm["kv_demand_bytes"], hbm["overflow_bytes"]
    overflow_replica = math.ceil(stored * overflow_gpu / demand) if demand else 0
    servers, replicas = inputs.num_servers, inputs.gpus_per_server // inputs.tensor_parallel
    overflow_server = overflow_replica * replicas
    dram = _take(overflow_server, inputs.dram_bytes_per_server)
    rest_cluster = (overflow_server - dram) * servers
    pool = _take(rest_cluster, inputs.pool_bytes)
    ssd_capacity = None if inputs.ssd_bytes_per_server is None else inputs.ssd_bytes_per_server * servers
    ssd = _take(rest_cluster - pool, ssd_capacity)
    unplaced = rest_cluster - pool - ssd
    cluster = {"hbm_bytes": hbm["kv_bytes"] * inputs.gpus_per_server * servers, "dram_bytes": dram * servers,
               "pool_bytes": pool, "ssd_bytes": ssd, "unplaced_bytes": unplaced}  # fmt: skip
    return {
        "placement": "exclusive",
        "capacities": {"dram_bytes_per_server": inputs.dram_bytes_per_server, "pool_bytes": inputs.pool_bytes,
                       "ssd_bytes_per_server": inputs.ssd_bytes_per_server},
        "overflow_bytes_per_replica": overflow_replica,
        "overflow_bytes_per_server": overflow_server,
        "overflow_bytes_cluster": overflow_server * servers,
        "per_server": {k: math.ceil(Fraction(v, servers)) for k, v in cluster.items()},
        "cluster": cluster,
    }


def _take(available: int, capacity: int | None) -> int:
    return available if capacity is None else min(available, capacity)


def _reload(geometry: ModelGeometry, workload: Workload, inputs: PlanInputs, share: Fraction) -> dict[str, Any]:
    ttft = inputs.ttft_target_s
    host_link = inputs.gpu.host_link if inputs.gpu else None
    contexts = []
    for label, tokens in workload.points:
        per_gpu = math.ceil(share * tokens * geometry.kv_bytes_per_token())
        contexts.append({"label": label, "context_tokens": tokens, "bytes_per_gpu": per_gpu,
                         "required_bytes_per_s": math.ceil(per_gpu / ttft)})  # fmt: skip
    fabrics = []
    for f in FABRICS:
        per_context = [{
            "context_tokens": c["context_tokens"], "seconds": c["bytes_per_gpu"] / f.bytes_per_s,
            "meets_target": c["bytes_per_gpu"] <= f.bytes_per_s * ttft,
            "links_needed": max(1, math.ceil(Fraction(c["required_bytes_per_s"], f.bytes_per_s))),
        } for c in contexts]  # fmt: skip
        fabrics.append({"name": f.name, "tier": f.link.value, "nominal_bytes_per_s": f.nominal_bytes_per_s,
                        "bytes_per_s": f.bytes_per_s, "gpu_host_link": f.name == host_link,
                        "contexts": per_context})  # fmt: skip
    return {"ttft_target_s": float(ttft), "contexts": contexts, "fabrics": fabrics,
            "assumes": "each GPU reloads its own share over its own link (one PCIe link, NIC and drive set per GPU)"}


# ---------------------------------------------------------------------------------------------
# verdict


def _verdict(report: dict[str, Any]) -> list[str]:
    lines = []
    if "weights" in report:
        w = report["weights"]
        per_gpu = f", {format_bytes(w['bytes_per_gpu'])} per GPU" if report["parallel"]["tensor_parallel"] > 1 else ""
        lines.append(f"weights: {format_params(w['num_params'])} in {w['dtype']} = {format_decimal(w['bytes'], 'B')} "
                     f"({format_bytes(w['bytes'])}){per_gpu}")  # fmt: skip
    if "hbm" in report:
        lines += _hbm_verdict(report["hbm"])
        lines += _tier_verdict(report["tiers"], report["parallel"]["num_servers"])
    return lines + [_reload_verdict(report["reload"])]


def _reload_verdict(reload: dict[str, Any]) -> str:
    """What reloading the longest reported context takes, and which single links manage it."""
    i, longest = max(enumerate(reload["contexts"]), key=lambda item: item[1]["context_tokens"])
    fast_enough = [f["name"] for f in reload["fabrics"] if f["contexts"][i]["meets_target"]]
    return (f"reload: {longest['context_tokens']:,} tokens ({format_bytes(longest['bytes_per_gpu'])} per GPU) within "
            f"{reload['ttft_target_s']:g} s needs {format_rate(longest['required_bytes_per_s'])} per GPU; "
            f"one link is enough on: {', '.join(fast_enough) or 'none'}")


def _hbm_verdict(h: dict[str, Any]) -> list[str]:
    budget = (f"weights {format_bytes(h['weights_bytes'])} + reserve {format_bytes(h['reserve_bytes'])} "
              f"+ KV {format_bytes(h['kv_demand_bytes'])} = {format_bytes(h['needed_bytes'])}")  # fmt: skip
    min_tp = h["min_tensor_parallel_to_fit"]
    tp_hint = f"; it fits at tensor-parallel {min_tp}" if min_tp and min_tp > h["tensor_parallel"] else ""
    if not h["weights_fit"]:
        return [(f"DOES NOT FIT: the weights alone ({format_bytes(h['weights_bytes'])} per GPU) exceed what "
                 f"{h['gpu']} ({format_bytes(h['hbm_bytes'])}) leaves after its reserve{tp_hint}")]
    if not h["fits"]:
        share = h["overflow_bytes"] / h["kv_demand_bytes"]
        lines = [(f"DOES NOT FIT in HBM: {budget} > {format_bytes(h['hbm_bytes'])} on {h['gpu']}; "
                  f"{format_bytes(h['overflow_bytes'])} of KV per GPU ({share:.0%}) must overflow to DRAM, pool "
                  f"or SSD{tp_hint}")]
    else:
        lines = [(f"fits in HBM: {budget} of {format_bytes(h['hbm_bytes'])} on {h['gpu']}, "
                  f"{format_bytes(h['free_bytes'])} free")]
    if not h["longest_context_fits"]:
        lines.append("the longest context does not fit in HBM even alone: it cannot be served at this TP degree")
    return lines


def _tier_verdict(t: dict[str, Any], num_servers: int) -> list[str]:
    if not t["overflow_bytes_cluster"]:
        return []
    s, c = t["per_server"], t["cluster"]
    line = (f"overflow per server: DRAM {format_bytes(s['dram_bytes'])}, pool {format_bytes(s['pool_bytes'])} "
            f"(cluster pool {format_bytes(c['pool_bytes'])} over {num_servers} server(s)), "
            f"SSD {format_bytes(s['ssd_bytes'])}")
    lines = [line]
    if c["unplaced_bytes"]:
        lines.append(f"{format_bytes(c['unplaced_bytes'])} of KV finds no tier within the capacities given "
                     "and will be recomputed")
    return lines
