"""`split_backward`: B -> BI (input cotangents) + BW (weight gradients), for zero-bubble orders."""

from __future__ import annotations

import json
from typing import AbstractSet, Sequence

from piper_jax.ir.build import compute_id
from piper_jax.ir.directives import Order
from piper_jax.ir.errors import DirectiveError
from piper_jax.ir.filters import select
from piper_jax.ir.graph import Edge, Graph, Node, NodeKind, Pass

__all__ = ["split_backward", "backward_split_keys"]

Key = tuple[int, int]  # (region, microbatch)


def _describe(n: Node) -> str:
  """A backward as its key and label, e.g. `{"PP": 0, "MB": 1} (r0B1)`."""
  return f"{json.dumps({**dict(n.tags), 'MB': n.mb})} ({n.label})"


def _as_filter(n: Node, pass_: str) -> str:
  """The order filter that names pass `pass_` of `n`'s key, as JSON."""
  return json.dumps({**dict(n.tags), "MB": n.mb, "PASS": pass_})


def backward_split_keys(graph: Graph, directives: Sequence[tuple[int, Order]]) -> set[Key]:
  """The (region, microbatch) keys whose B the `order` directives name as BI and BW.

  A filter naming PASS "BI" or "BW" names every B node it would match with PASS
  "B" ("*" for MB or PP names each key it matches). As in Piper, each such key
  needs exactly one BI and one BW entry, in the same order directive with the BI
  first, and no entry naming its fused B; any other key keeps its fused B.

  Args:
    graph: the graph after `split_microbatches` (B nodes carry `mb`).
    directives: the order directives with their index in the directive list.

  Raises:
    DirectiveError: naming the directive of an entry that breaks one of the rules.
  """
  backwards = [n for n in graph.compute_nodes() if n.pass_ is Pass.B]
  # Per key and pass: (directive index, directive, (group, filter) position), one per group.
  named: dict[Key, dict[str, list[tuple[int, Order, tuple[int, int]]]]] = {}
  for index, d in directives:
    for gi, g in enumerate(d.groups):
      for fi, f in enumerate(g):
        pass_ = dict(f).get("PASS")
        if pass_ not in ("B", "BI", "BW"):
          continue
        as_b = tuple((t, "B" if t == "PASS" else v) for t, v in f)
        for n in select(graph, as_b, kinds=(NodeKind.COMPUTE,)):
          entries = named.setdefault((n.region, n.mb), {}).setdefault(pass_, [])
          if not any(i == index and pos[0] == gi for i, _, pos in entries):
            entries.append((index, d, (gi, fi)))
  by_key = {(n.region, n.mb): n for n in backwards}
  keys = set()
  for key in sorted(named):
    entries = named[key]
    bi, bw, fused = entries.get("BI", []), entries.get("BW", []), entries.get("B", [])
    if not bi and not bw:
      continue
    n = by_key[key]
    what = _describe(n)
    for mine, other, p, q in ((bi, bw, "BI", "BW"), (bw, bi, "BW", "BI")):
      if mine and not other:
        index, d, _ = mine[0]
        side = "after" if p == "BI" else "before"
        raise DirectiveError(
            f"orders the {p} of {what} but no order directive names its {q}; add "
            f"{_as_filter(n, q)} to this order {side} the {p}, or name the fused backward "
            f"{_as_filter(n, 'B')} instead", index, d)
      if len(mine) > 1:
        index, d, _ = mine[1]
        where = ", ".join(f"directive {i} group {pos[0]}" for i, _, pos in mine)
        raise DirectiveError(f"names the {p} of {what} more than once ({where}); name it in "
                             f"one group of one order directive", index, d)
    (bi_index, _, bi_pos), (bw_index, bw_d, bw_pos) = bi[0], bw[0]
    if bi_index != bw_index:
      raise DirectiveError(
          f"orders the BW of {what} but its BI is in directive {bi_index}; put the BI and BW "
          f"of one backward in the same order directive, BI first", bw_index, bw_d)
    if bw_pos < bi_pos:
      where = (f"in group {bw_pos[0]} before its BI" if bw_pos[0] == bi_pos[0] else
               f"(group {bw_pos[0]}) before its BI (group {bi_pos[0]})")
      raise DirectiveError(
          f"orders the BW of {what} {where}; BW reads what BI computes, so put "
          f"{_as_filter(n, 'BI')} before {_as_filter(n, 'BW')}", bw_index, bw_d)
    if fused:
      index, d, _ = fused[0]
      raise DirectiveError(
          f"names the fused B of {what}, which directive {bi_index} splits into BI and BW; "
          f"name this backward either as B or as BI and BW", index, d)
    keys.add(key)
  return keys


def split_backward(graph: Graph, keys: AbstractSet[Key]) -> Graph:
  """Replaces the B node of each (region, microbatch) key in `keys` by BI and BW.

  Needs: a split graph. Inserts: BI takes B's incoming cotangents and sends B's
  outgoing ones; BW reads F's residuals and what BI leaves for it (edge BI -> BW)
  and feeds the UPDATE. After: no B node of a key in `keys`, the other B nodes
  unchanged (a fused B may send to or receive from a BI); BW never precedes its BI.
  """
  nodes, rename = [], {}
  for n in graph.nodes.values():
    if n.kind is NodeKind.COMPUTE and n.pass_ is Pass.B and (n.region, n.mb) in keys:
      bi = n.replace(id=compute_id(n.region, Pass.BI, n.mb), pass_=Pass.BI)
      bw = n.replace(id=compute_id(n.region, Pass.BW, n.mb), pass_=Pass.BW)
      nodes += [bi, bw]
      rename[n.id] = (bi.id, bw.id)
    else:
      nodes.append(n)
  edges = []
  for e in graph.edges:
    src, dst = e.src, e.dst
    if src in rename and graph.nodes[dst].kind is NodeKind.UPDATE:
      edges.append(Edge(rename[src][1], dst, e.kind, e.tensor))
      continue
    if dst in rename and graph.nodes[src].kind is NodeKind.COMPUTE and graph.nodes[src].pass_ is Pass.F:
      edges.append(Edge(src, rename[dst][0], e.kind, e.tensor))
      edges.append(Edge(src, rename[dst][1], e.kind, e.tensor))
      continue
    src = rename[src][0] if src in rename else src
    dst = rename[dst][0] if dst in rename else dst
    edges.append(Edge(src, dst, e.kind, e.tensor))
  for bi, bw in rename.values():
    edges.append(Edge(bi, bw))
  return Graph(nodes, edges)
