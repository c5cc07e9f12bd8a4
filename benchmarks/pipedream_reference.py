"""A reference re-implementation of PipeDream's own optimizer, to check ours against.

Written from the algorithm in msr-fiddle/pipedream (graph/graph.py: antichain DAG
enumeration; optimizer/optimizer_graph_hierarchical.py: compute_partitioning and
the per-level loop), keeping its conventions and quirks on purpose, because the
point is to reproduce ITS optimum:

- `Input*` sources are removed, `__getitem__*` sinks are dropped (one pass);
- states are the antichains reachable from the first source by PipeDream's
  augment / next-antichain rules; a state's compute, activation and parameter
  sizes sum over all its predecessors (its ideal);
- A[i][j][m] = min(single stage replicated m+1 times, min over ancestor states k
  and m' of max(A[i][k][m-m'], last stage)); compute + all-reduce are summed;
- the single-stage all-reduce is divided by the number of devices inside a unit
  of the level; the split stage's is not (PipeDream's code does exactly that;
  `consistent_levels=True` divides both, which is what pipeplan does);
- with `use_fewer_machines`, A[i][j][m] may take A[i][j][m-1] (only for j > i).

Not a copy: no graphviz, no printing, no output files, no memory constraint,
no activation compression. Cost: O(S^2 N^2) per level-start i, all i for inner
levels, and S explodes on wide DAGs - that is what pipeplan avoids.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class RefGraph:
    def __init__(self, nodes: dict, edges: list[tuple[str, str]]):
        self.nodes = dict(nodes)  # id -> [desc, fwd_ms, bwd_ms, act, param]
        self.out: dict[str, list[str]] = {}
        self.inn: dict[str, list[str]] = {}
        for s, d in edges:
            self.out.setdefault(s, []).append(d)
            self.inn.setdefault(d, []).append(s)
        self._pred: dict[str, set] = {}
        self._succ: dict[str, set] = {}
        self._aug: dict = {}

    def sources(self):
        return [n for n in self.nodes if not self.inn.get(n)]

    def sinks(self):
        return [n for n in self.nodes if not self.out.get(n)]

    def remove(self, n):
        del self.nodes[n]
        for d in self.out.pop(n, []):
            self.inn[d].remove(n)
        for s in self.inn.pop(n, []):
            self.out[s].remove(n)

    def predecessors(self, n) -> set:
        if n in self._pred:
            return self._pred[n]
        result = set()
        stack = list(self.inn.get(n, []))
        while stack:
            x = stack.pop()
            if x not in result:
                result.add(x)
                stack.extend(self.inn.get(x, []))
        self._pred[n] = result
        return result

    def successors(self, n) -> set:
        if n in self._succ:
            return self._succ[n]
        result = set()
        stack = list(self.out.get(n, []))
        while stack:
            x = stack.pop()
            if x not in result:
                result.add(x)
                stack.extend(self.out.get(x, []))
        self._succ[n] = result
        return result

    def augment(self, antichain):
        key = tuple(sorted(antichain))
        if key not in self._aug:
            extra = set()
            for a in antichain:
                preds = self.predecessors(a)
                for p in preds:
                    for o in self.out.get(p, []):
                        if o not in preds and o != a:
                            extra.add(p)
            self._aug[key] = sorted(extra) + list(antichain)
        return self._aug[key]

    def deaugment(self, aug):
        remove = set()
        for x in aug:
            succ = self.successors(x)
            if any(y in succ for y in aug):
                remove.add(x)
        out = []
        for x in aug:
            if x not in remove and x not in out:
                out.append(x)
        return out

    def next_antichains(self, antichain):
        aset = set(antichain)
        aug = self.augment(antichain)
        augset = set(aug)
        result = []
        for node in aug:
            for nxt in self.out.get(node, []):
                if nxt in aset:
                    continue
                if any(s in augset for s in self.successors(nxt)):
                    continue
                result.append(self.deaugment([x if x != node else nxt for x in aug]))
        return result

    def antichain_dag(self, max_states: int | None = None):
        """States (augmented antichains) and their DAG edges, in BFS discovery order."""
        start = [self.sources()[0]]
        states = [self.augment(start)]
        index = {tuple(sorted(start)): 0}
        edges = set()
        queue = [start]
        done = set()
        while queue:
            ac = queue.pop(0)
            key = tuple(sorted(ac))
            if key in done:
                continue
            done.add(key)
            for nxt in self.next_antichains(ac):
                nkey = tuple(sorted(nxt))
                if nkey not in index:
                    index[nkey] = len(states)
                    states.append(self.augment(nxt))
                    if max_states is not None and len(states) > max_states:
                        raise TooManyStates(len(states))
                edges.add((index[key], index[nkey]))
                queue.append(nxt)
        return states, edges


class TooManyStates(Exception):
    pass


def prepare(path: str, max_states: int | None = None):
    """-> per-state (compute_s, activation, param, output_activation) in a topological order, ancestors."""
    from pipeplan.costmodels.pipedream_import import parse_pipedream

    nodes, edges = parse_pipedream(Path(path).read_text(), path)
    g = RefGraph({k: list(v) for k, v in nodes.items()}, edges)
    for s in g.sources():
        if g.nodes[s][0].startswith("Input"):
            g.remove(s)
    for s in g.sinks():
        if g.nodes[s][0].startswith("__getitem__"):
            g.remove(s)
    states, dag_edges = g.antichain_dag(max_states)
    S = len(states)
    preds = [[] for _ in range(S)]
    succs = [[] for _ in range(S)]
    for a, b in dag_edges:
        preds[b].append(a)
        succs[a].append(b)
    # topological order (Kahn; any order is valid for the DP)
    indeg = [len(p) for p in preds]
    order = [i for i in range(S) if indeg[i] == 0]
    for i in order:
        for j in succs[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                order.append(j)
    pos = {s: i for i, s in enumerate(order)}
    info = []
    for s in order:
        ac = states[s]
        ideal = set(ac)
        for x in ac:
            ideal |= g.predecessors(x)
        compute = sum((g.nodes[x][1] + g.nodes[x][2]) / 1000.0 for x in ideal)
        act = sum(g.nodes[x][3] for x in ideal)
        param = sum(g.nodes[x][4] for x in ideal)
        out_act = sum(g.nodes[x][3] for x in ac)
        info.append((compute, act, param, out_act))
    # all ancestors in the antichain DAG, as positions in `order`
    anc: list[set] = [set() for _ in range(S)]
    for s in order:
        for p in preds[s]:
            anc[pos[s]] |= anc[pos[p]] | {pos[p]}
    return info, [sorted(a) for a in anc]


def compute_partitioning(compute, params, ancestors, N, within, bandwidth, final_level, use_fewer, consistent):
    S = len(compute[0])
    A = [[[None] * N for _ in range(S)] for _ in range(len(compute))]
    for i in range(len(compute)):
        for j in range(i, S):
            c = compute[i][j]
            if c is None:
                continue
            p = params[i][j]
            for m in range(N):
                dp = (4 * m * p) / (bandwidth * (m + 1)) / within
                A[i][j][m] = ((c + dp) / (m + 1), None, m + 1)
    max_i = 1 if final_level else len(compute)
    for i in range(max_i):
        for m in range(1, N):
            for j in range(i + 1, S):
                best = A[i][j][m]
                if use_fewer and m > 0 and (best is None or (A[i][j][m - 1] is not None and A[i][j][m - 1][0] < best[0])):
                    best = A[i][j][m - 1]
                for k in ancestors[j]:
                    if i > 0 and k in ancestors[i - 1]:
                        continue
                    last_c = compute[k + 1][j]
                    if last_c is None:
                        continue
                    last_p = params[k + 1][j]
                    for mp in range(1, m + 1):
                        prev = A[i][k][m - mp]
                        if prev is None:
                            continue
                        dp = 4 * (mp - 1) * last_p / (bandwidth * mp)
                        if consistent:
                            dp /= within
                        t = max(prev[0], (last_c + dp) / mp)
                        if best is None or best[0] > t:
                            best = (t, (k, m - mp), mp)
                A[i][j][m] = best
    return A


def reference_optimum(path: str, levels: list[tuple[int, float]], *, use_fewer_machines: bool = True,
                      consistent_levels: bool = False, max_states: int | None = None) -> float:
    """PipeDream's optimal pipeline time for `levels` = [(machines, bandwidth bytes/s)], innermost first."""
    info, ancestors = prepare(path, max_states)
    S = len(info)

    def table(k):
        rows = []
        for i in range(S + 1):
            row = []
            for j in range(S):
                if i == 0:
                    row.append(info[j][k])
                elif j > i - 1:
                    row.append(info[j][k] - info[i - 1][k])
                else:
                    row.append(None)
            rows.append(row)
        return rows

    compute, params = table(0), table(2)
    within = 1
    A = None
    for level, (N, bw) in enumerate(levels):
        A = compute_partitioning(compute, params, ancestors, N, within, bw, level == len(levels) - 1,
                                 use_fewer_machines, consistent_levels)
        within = N
        for i in range(len(compute)):
            for j in range(S):
                compute[i][j] = A[i][j][-1][0] if A[i][j][-1] is not None else None
    return A[0][S - 1][levels[-1][0] - 1][0]


def states_count(path: str, max_states: int | None = None) -> int:
    info, _ = prepare(path, max_states)
    return len(info)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graph")
    ap.add_argument("-n", type=int, nargs="+", required=True)
    ap.add_argument("-b", type=float, nargs="+", required=True)
    ap.add_argument("--exact-machines", action="store_true", help="PipeDream's default (no --use_fewer_machines)")
    ap.add_argument("--max-states", type=int, default=None, help="give up past this many antichain states")
    args = ap.parse_args()
    try:
        levels = list(zip(args.n, args.b, strict=False))
        print(reference_optimum(args.graph, levels, use_fewer_machines=not args.exact_machines,
                                max_states=args.max_states))
    except TooManyStates as e:
        print(f"too many antichain states (> {args.max_states}, stopped at {e.args[0]})", file=sys.stderr)
        sys.exit(3)
