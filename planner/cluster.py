"""A mixed cluster: groups of devices of several hardware profiles and the link between the groups.

`--cluster a100-80gb-sxm:8,v100-32gb-sxm2:8` names the groups in order (a profile
and a device count each); `--cluster-link GBPS[,LATENCY_US]` (or a `link=GBPS[/LATENCY_US]`
item) sets the link between groups. Without it the link between groups is the
slower of the groups' own inter-node links (lower bandwidth; on a tie the higher
latency): two kinds of machine sit in different nodes, so their traffic crosses
the network, and a transfer runs at the pace of its slower end (the alpha-beta
model of `costmodels.comm.p2p_time_s`). HetPipe (Park et al., ATC'20 §4) and
PipeDream's hierarchy (SOSP'19 §3.1) place stages the same way: each stage on one
kind of device, the pipeline crossing between kinds over the network.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeplan.errors import UserError
from pipeplan.hardware_profiles.profile import HardwareProfile, Link

__all__ = ["ClusterGroup", "Cluster", "parse_cluster", "parse_link", "default_link", "MAX_GROUPS"]

MAX_GROUPS = 4  # placements grow with the orders of the groups (4! = 24); more kinds are not a real cluster
GBPS = 1e9  # profiles' bandwidth_gbps are GB/s (hardware_profiles/loader.py)


@dataclass(frozen=True)
class ClusterGroup:
    profile: HardwareProfile
    count: int  # devices of this profile


@dataclass(frozen=True)
class Cluster:
    groups: tuple[ClusterGroup, ...]
    link: Link  # between any two groups
    spec: str  # as the user wrote it (plans record it as their profile)

    @property
    def devices(self) -> int:
        return sum(g.count for g in self.groups)

    def offset(self, g: int) -> int:
        """Global rank of group g's first device (groups take consecutive ranks in the order given)."""
        return sum(x.count for x in self.groups[:g])


def default_link(profiles: list[HardwareProfile]) -> Link:
    """The slower of the groups' inter-node links (module docstring says why)."""
    return min((p.inter_node for p in profiles), key=lambda lk: (lk.bandwidth_bytes_per_s, -lk.latency_s))


def parse_link(text: str, flag: str = "--cluster-link") -> Link:
    """GBPS[,LATENCY_US] (or with '/' inside a --cluster item): a link between groups."""
    parts = text.replace("/", ",").split(",")
    try:
        gbps = float(parts[0])
        latency_us = float(parts[1]) if len(parts) > 1 else 5.0
    except ValueError:
        raise UserError(f"{flag} {text}: not GBPS[,LATENCY_US]", "e.g. 25,5 (25 GB/s, 5 us)") from None
    if len(parts) > 2 or not 0 < gbps < 1e6 or not 0 <= latency_us < 1e6:
        raise UserError(f"{flag} {text}: bandwidth must be in (0, 1e6) GB/s and latency in [0, 1e6) us",
                        "e.g. 25,5 (25 GB/s, 5 us)")
    return Link(kind="cluster", bandwidth_bytes_per_s=gbps * GBPS, latency_s=latency_us * 1e-6)


def _group(item: str, load: Callable[[str], HardwareProfile], max_count: int) -> ClusterGroup:
    name, sep, n = item.rpartition(":")
    if not sep or not name:
        raise UserError(f"--cluster item {item!r} is not PROFILE:COUNT", "e.g. --cluster a100-80gb-sxm:8,v100-32gb-sxm2:8")
    if not n.isdigit() or not 1 <= int(n) <= max_count:
        raise UserError(f"--cluster item {item!r}: the count must be a whole number from 1 to {max_count}",
                        "e.g. a100-80gb-sxm:8")
    try:
        profile = load(name)
    except UserError as e:
        raise UserError(f"--cluster item {item!r}: {e.args[0] if e.args else e}",
                        "see `pipeplan profiles list` for the catalogue names") from None
    return ClusterGroup(profile, int(n))


def parse_cluster(spec: str, load: Callable[[str], HardwareProfile], *, max_count: int,
                  link: str | None = None) -> Cluster:
    """`PROFILE:COUNT,PROFILE:COUNT[,link=GBPS/LATENCY_US]` into a `Cluster` (user errors name --cluster)."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    links = [s for s in items if s.startswith("link=")]
    if links and link is not None:
        raise UserError("--cluster has a link= item and --cluster-link is given too", "give the link once")
    groups = [_group(s, load, max_count) for s in items if not s.startswith("link=")]
    if len(groups) < 2:
        raise UserError(f"--cluster {spec!r} names one group", "use --profile and --gpus for devices of one kind")
    if len(groups) > MAX_GROUPS:
        raise UserError(f"--cluster {spec!r} names {len(groups)} groups", f"use at most {MAX_GROUPS}")
    names = [g.profile.name for g in groups]
    if len(set(names)) != len(names):
        raise UserError(f"--cluster {spec!r} names a profile twice", "give each profile once with its total count")
    if sum(g.count for g in groups) > max_count:
        raise UserError(f"--cluster {spec!r} has more than {max_count} devices")
    if links:
        chosen = parse_link(links[-1][5:], "--cluster link=")
    elif link is not None:
        chosen = parse_link(link)
    else:
        chosen = default_link([g.profile for g in groups])
    return Cluster(tuple(groups), chosen, spec)
