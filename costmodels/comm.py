"""Communication cost: what moving bytes between devices costs.

Two primitives are enough for pipeline planning: a point-to-point send between
neighbouring stages (activations forward, gradients backward) and a ring
all-reduce of a stage's weight gradients across its data-parallel replicas.
Both are the classic latency-bandwidth ("alpha-beta", Hockney 1994) model; the
link to use comes from the profile's hierarchy (same node or across nodes).
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeplan.hardware_profiles.collectives import link_at_size
from pipeplan.hardware_profiles.profile import HardwareProfile, Link


def p2p_time_s(nbytes: float, link: Link) -> float:
    """Time of one point-to-point send: latency + bytes / bandwidth.

    Source: the alpha-beta model (Hockney, "The communication challenge for MPP",
    Parallel Computing 1994): T(n) = alpha + n / beta. `link.bandwidth_bytes_per_s`
    is one direction per device, which is what one send can use. No bytes means
    no message at all, so it costs nothing (not even the latency).
    """
    if nbytes < 0:
        raise ValueError(f"negative byte count {nbytes}")
    if nbytes == 0:
        return 0.0
    return link.latency_s + float(nbytes) / link.bandwidth_bytes_per_s


def allreduce_time_s(nbytes: float, replicas: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `replicas` devices.

    Source: Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for
    clusters of workstations" (JPDC 2009), and the NCCL performance notes
    (nccl-tests doc/PERFORMANCE.md, "bus bandwidth" = algbw * 2(n-1)/n): a
    reduce-scatter then an all-gather, 2(r-1) steps, each moving nbytes/r over
    every device's link. Time = 2(r-1)/r * nbytes / bw + 2(r-1) * latency.
    A single replica has nothing to reduce: 0.
    """
    return 2.0 * half_ring_time_s(nbytes, replicas, link)  # a reduce-scatter then an all-gather


def half_ring_time_s(nbytes: float, replicas: int, link: Link) -> float:
    """Ring reduce-scatter, or ring all-gather, of `nbytes` (the whole, unsharded tensor) over `replicas`.

    Source: the same ring as `allreduce_time_s`, which is a reduce-scatter followed
    by an all-gather (Patarasuk & Yuan 2009; NCCL's "bus bandwidth" factor for both
    collectives is (n-1)/n, nccl-tests doc/PERFORMANCE.md): r-1 steps, each moving
    nbytes/r over every device's link. ZeRO-1 (a reduce-scatter of gradients and an
    all-gather of parameters) therefore moves what one all-reduce moves
    (Rajbhandari et al. 2019 §7.2.1).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if nbytes < 0:
        raise ValueError(f"negative byte count {nbytes}")
    if replicas == 1 or nbytes == 0:
        return 0.0
    steps = replicas - 1
    return steps / replicas * float(nbytes) / link.bandwidth_bytes_per_s + steps * link.latency_s


def group_link(profile: HardwareProfile, ranks: Iterable[int]) -> Link:
    """The link a collective over `ranks` is limited by.

    A ring that leaves a node crosses the inter-node link at least twice, and a
    ring is as slow as its slowest hop, so any group spanning nodes runs at the
    inter-node speed (a hierarchical all-reduce would do better; we keep the
    ring, as PipeDream's planner does per bandwidth level).
    """
    ranks = list(ranks)
    if not ranks:
        raise ValueError("empty device group")
    nodes = {r // profile.devices_per_node for r in ranks}
    return profile.intra_node if len(nodes) == 1 else profile.inter_node


def collective_link(profile: HardwareProfile, ranks: Iterable[int], op: str, nbytes: float | None = None) -> Link:
    """The link `op` ("allreduce", "reduce_scatter", "all_gather") over `ranks` is priced with: the profile's
    measured collective within a node where it has one (a local profile: gloo's collectives on the CPU), read
    at `nbytes` (the whole tensor) off the sizes calibrate timed where they bracket it
    (hardware_profiles/collectives.link_at_size), else `group_link`."""
    ranks = list(ranks)
    link = group_link(profile, ranks)
    if op not in profile.collectives or link is not profile.intra_node:
        return link
    measured = ((getattr(profile, "calibration", None) or {}).get("collectives_us") or {}).get(op) or {}
    if nbytes is None or not measured:
        return profile.collectives[op]
    by_size_s = {int(k): float(v) * 1e-6 for k, v in measured.items()}
    return link_at_size(profile.collectives[op], op, by_size_s, nbytes)


def send_time_between_s(nbytes: float, profile: HardwareProfile, src_rank: int, dst_rank: int) -> float:
    """Point-to-point send between two global device ranks over the right level of the hierarchy."""
    return p2p_time_s(nbytes, profile.link_between(src_rank, dst_rank))
