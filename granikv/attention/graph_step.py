"""The prefix paths of a decode step as ONE captured CUDA graph per batch size: the plan is data.

Per layer the captured step runs, every tensor of the captured batch size B:

    rest decode over every row, the split rows' prefixes left out     (the caller's decode wrapper)
    qp = q[perm], qn = qp per head x F   ONE gather: rows grouped dense launch 0 | 1 | ... | cascade | rest
                                         (a step in which no row splits skips it: nothing reads the launches)
    per dense launch (KV fold f):  ONE ragged prefill over the dense source (granikv.attention.hot_batch),
                                   f sub-states per head left unmerged
    cascade:                       ONE paged batch prefill, a segment per class, over its prefix slots
    merge_rows(o, lse, [dense states..., cascade state], kind, src, folds)   one launch, the folds merged too

Each launch reads one run of ``qp``: rows before its run form a lead segment over a dummy key (the dense
source's first ``dummy`` keys, which no slab holds) or a dummy slot (cascade); its last class takes its rows
rounded up to ``row_bucket`` (the next rows of ``qp``, so that a request joining or leaving the class seldom
changes the launch's segments and FlashInfer's host plan); rows after that are not covered. The outputs of
rows outside a launch's classes are never read: row r merges only the source ``kind[r]`` names, at ``src[r]``.

What changes from step to step (classes, paths, slabs, row order) is written into fixed buffers before
the replay: :func:`plan_graph_step` is the host arithmetic (pure, no tensor), :meth:`GraphStep.load` one
pinned host->device copy, the cascade's slot list built on the device, and a FlashInfer re-plan only of a
launch whose segments changed. The dense source is the KV pool itself (GraniKV: the HOT slabs are views of
it) or a scratch the prefix slots are gathered into per layer (HydraGen).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from granikv.attention import flashinfer_ops as fo
from granikv.attention.batch import arange
from granikv.attention.hot_batch import HotBatch, HotGroup, plan_hot_batch
from granikv.attention.plan import ClassPlan, group_prefix_classes
from granikv.attention.policy import PrefixPolicy
from granikv.attention.row_kernels import gather_q, gather_rows, merge_rows
from granikv.attention.staging import PinnedStaging

DENSE = ("dense", "hydragen")


@dataclass(frozen=True)
class GraphLimits:
    """What one captured step holds. ``region_len``: keys of the dense source from slot 0 (the KV pool's
    size, or HydraGen's scratch); ``cascade_slots``: prefix slots all cascade classes of a step may hold."""

    batch: int
    folds: tuple[int, ...] = (1,)      # the KV fold of each dense launch
    fold_min_len: int = 0              # a class takes the last (most folded) launch at Lp >= this
    groups: int = 8                    # dense groups per launch
    cascades: int = 8                  # cascade classes
    region_len: int = 0
    cascade_slots: int = 0
    scratch: bool = False              # the dense source is a scratch the prefixes are gathered into (HydraGen)
    row_bucket: int = 1                # a launch's last class is planned over its rows rounded up to a multiple

    def __post_init__(self):
        if self.batch < 1:
            raise ValueError(f"GraphLimits.batch: must be >= 1, got {self.batch}")
        if not self.folds or any(f < 1 or f & (f - 1) for f in self.folds) or len(set(self.folds)) != len(self.folds):
            raise ValueError(f"GraphLimits.folds: distinct powers of two >= 1, got {self.folds}")
        if self.row_bucket < 1:
            raise ValueError(f"GraphLimits.row_bucket: must be >= 1, got {self.row_bucket}")
        if self.groups < 1 or self.cascades < 0 or self.region_len < 0 or self.cascade_slots < 0:
            raise ValueError(f"GraphLimits: groups >= 1, cascades / region_len / cascade_slots >= 0, got {self}")

    @property
    def dummy(self) -> int:
        """Keys at the dense source's start that no slab may hold (the lead segments' dummy)."""
        return max(self.folds)

    @property
    def dense_segments(self) -> int:
        """Segments of a dense launch: the lead, a gap and a group per group, the tail."""
        return 2 * self.groups + 2


@dataclass
class GraphStepPlan:
    """One step's data, host lists (module doc). Rows are the captured batch's (B)."""

    perm: list[int]                        # [B] qp row p is batch row perm[p]
    src: list[int]                         # [B] batch row r sits at qp row src[r]
    kind: list[int]                        # [B] 0 none, i+1 dense launch i, len(folds)+1 cascade
    skip: list[int]                        # [B] prefix slots row r leaves out of the rest decode
    dense: list                            # per launch: HotBatchPlan
    cas_qo: list[int]                      # [C+2] query rows per cascade segment (lead, classes, pads)
    cas_kv: list[int]                      # [C+2] slots per segment
    cas_rows: list[int]                    # [C+1] batch row whose slot-table row holds the segment's slots
    gather: list[tuple[int, int, int]] = field(default_factory=list)   # HydraGen: (row, Lp, scratch offset)
    classes: list[ClassPlan] = field(default_factory=list)
    choose_us: float = 0.0
    cas_ids: tuple = ()                    # prefix ids of the cascade classes, in segment order
    gather_ids: tuple = ()                 # prefix ids of the gathered (HydraGen) classes, in ``gather`` order

    @property
    def split(self) -> bool:
        """Whether any row merges a prefix state."""
        return any(self.kind)

    def decisions(self, group: int, batch: int) -> list[dict]:
        """The step trace: one dict per class (the path it ran), one for the rows without a prefix."""
        out = [{"prefix_id": c.prefix_id, "batch": len(c.rows), "meff": c.meff, "prefix_len": c.prefix_len,
                "hot": c.hot_start >= 0, "backend": c.choice} for c in self.classes]
        nopfx = batch - sum(len(c.rows) for c in self.classes)
        if nopfx:
            out.append({"prefix_id": -1, "batch": nopfx, "meff": nopfx * group, "prefix_len": 0, "hot": False,
                        "backend": "paged"})
        return out


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _bucketed(g: HotGroup, lim: GraphLimits) -> HotGroup:
    """A launch's last group with its rows rounded up to ``lim.row_bucket`` (at most to the batch's end): the
    rows it takes past its own are the next rows of ``qp`` (later launches', cascade, rest or pad rows), whose
    outputs from this launch no row merges. The plan then changes only when the class crosses a multiple."""
    return HotGroup(g.hot_start, g.prefix_len, g.row_start,
                    min(_round_up(g.rows, lim.row_bucket), lim.batch - g.row_start))


def _fits(start: int, lp: int, fold: int, lim: GraphLimits) -> bool:
    return start % fold == 0 and lp % fold == 0 and start >= lim.dummy and start + lp <= lim.region_len // fold * fold


def plan_graph_step(ids: list[int], lens: list[int], hots: list[int], lim: GraphLimits, policy: PrefixPolicy,
                    group: int) -> GraphStepPlan:
    """The data of one step: the first ``len(ids)`` rows are requests (the rest, to ``lim.batch``, CUDA-graph
    padding without a prefix). The policy picks each class's path; a path the captured step cannot hold is
    moved: a dense class to the cascade launch (a slab off the fold, past the region, or too many groups),
    a cascade class to paged (too many classes or slots), a HydraGen class to paged (scratch full). Each
    class's ``choice`` is the path it runs. Raises ValueError naming the field."""
    b, raw = lim.batch, len(ids)
    if raw > b or not len(lens) == len(hots) == raw:
        raise ValueError(f"plan_graph_step: {raw} rows of ids / lens / hots ({len(lens)}, {len(hots)}) for a "
                         f"captured batch of {b}")
    classes = group_prefix_classes(ids, lens, hots)
    for c in classes:
        n = len(c.rows)
        c.meff, c.n_real = n * group, n
        c.row_start = c.rows[0] if c.rows[-1] - c.rows[0] + 1 == n else -1
    t0 = time.perf_counter()
    policy.choose(classes, raw)
    choose_us = (time.perf_counter() - t0) * 1e6
    nl = len(lim.folds)
    launches: list[list[tuple[ClassPlan, int]]] = [[] for _ in range(nl)]   # (class, start in the dense source)
    cas: list[ClassPlan] = []
    gather: list[tuple[int, int, int]] = []
    cas_slots, scratch_end = 0, lim.dummy

    def to_cascade(c: ClassPlan) -> None:
        nonlocal cas_slots
        if len(cas) < lim.cascades and cas_slots + c.prefix_len <= lim.cascade_slots:
            c.choice = "cascade"
            cas.append(c)
            cas_slots += c.prefix_len
        else:
            c.choice = "paged"

    for c in classes:
        if c.choice in DENSE:
            lp = c.prefix_len
            first = nl - 1 if lp >= lim.fold_min_len else 0
            placed = False
            for i in dict.fromkeys((first, 0)):
                f = lim.folds[i]
                if len(launches[i]) >= lim.groups:
                    continue
                if c.choice == "hydragen":
                    start = -(-scratch_end // f) * f
                    if lim.scratch and _fits(start, lp, f, lim):
                        launches[i].append((c, start))
                        gather.append((c.rows[0], lp, start))
                        scratch_end = start + lp
                        placed = True
                        break
                elif not lim.scratch and c.hot_start >= 0 and _fits(c.hot_start, lp, f, lim):
                    launches[i].append((c, c.hot_start))
                    placed = True
                    break
            if not placed:
                if c.choice == "hydragen":
                    c.choice = "paged"
                else:
                    to_cascade(c)
        elif c.choice == "cascade":
            to_cascade(c)
    # the permutation: each launch's groups in slab address order, then the cascade classes, then the rest
    perm: list[int] = []
    kind = [0] * b
    skip = [0] * b
    dense = []
    for i, gl in enumerate(launches):
        lead = len(perm)
        groups = []
        for c, start in sorted(gl, key=lambda x: x[1]):
            groups.append(HotGroup(start, c.prefix_len, len(perm), len(c.rows)))
            perm.extend(c.rows)
            for r in c.rows:
                kind[r], skip[r] = i + 1, c.prefix_len
        if groups:
            groups[-1] = _bucketed(groups[-1], lim)
        f = lim.folds[i]
        dense.append(plan_hot_batch(groups, fold=f, max_segments=lim.dense_segments,
                                    region=(0, lim.region_len // f * f), lead_rows=lead if groups else 0))
    nd = len(perm)
    # the lead: rows [0, nd), one dummy slot; with no cascade class, no row (the launch has no work): every
    # such step has the same segments, so its FlashInfer plan is made once and kept (no host re-plan)
    cas_qo, cas_kv, cas_rows = [0, nd if cas else 0], [0, 1], [0]
    for c in cas:
        perm.extend(c.rows)
        for r in c.rows:
            kind[r], skip[r] = nl + 1, c.prefix_len
        cas_qo.append(len(perm))
        cas_kv.append(cas_kv[-1] + c.prefix_len)
        cas_rows.append(c.rows[0])
    if cas:                                                          # the last class's rows, bucketed
        cas_qo[-1] = min(b, cas_qo[-2] + _round_up(cas_qo[-1] - cas_qo[-2], lim.row_bucket))
    for _ in range(lim.cascades - len(cas)):                         # pads: no rows, one dummy slot
        cas_qo.append(cas_qo[-1])
        cas_kv.append(cas_kv[-1] + 1)
        cas_rows.append(0)
    taken = set(perm)
    perm.extend(r for r in range(b) if r not in taken)
    src = [0] * b
    for p, r in enumerate(perm):
        src[r] = p
    gids = tuple(c.prefix_id for gl in launches for c, _ in gl if c.choice == "hydragen")
    return GraphStepPlan(perm, src, kind, skip, dense, cas_qo, cas_kv, cas_rows, gather, classes, choose_us,
                         tuple(c.prefix_id for c in cas), gids)


def capture_plan(lim: GraphLimits) -> GraphStepPlan:
    """The plan a step is captured with: every launch covers all B rows (FlashInfer sizes a captured
    launch's work on its first plan), no row merges anything."""
    b = lim.batch
    dense = []
    for f in lim.folds:
        region = lim.region_len // f * f
        if region < 2 * lim.dummy:
            raise ValueError(f"GraphLimits.region_len: {lim.region_len} keys hold no slab past the dummy {lim.dummy}")
        g = HotGroup(lim.dummy, f, 0, b)
        dense.append(plan_hot_batch([g], fold=f, max_segments=lim.dense_segments, region=(0, region)))
    cas_qo = [0, b] + [b] * lim.cascades
    cas_kv = list(range(lim.cascades + 2))
    return GraphStepPlan(list(range(b)), list(range(b)), [0] * b, [0] * b, dense, cas_qo, cas_kv,
                         [0] * (lim.cascades + 1))


def shared_buffers(lim: GraphLimits, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device | str) -> dict:
    """The large buffers every captured step of a backend can share (steps run one at a time, and each
    step's ``load`` rewrites what its ``run`` reads): the cascade slot list (int32 [cascade_slots +
    cascades + 1]) and, for a scratch source, HydraGen's scratch K / V ([region_len, Hkv, D]) and its gather
    pairs (int32 [region_len] each). ``lim``: the largest step's limits (its batch size does not matter).
    ``key``: what the slot lists hold (which step wrote them, its segments and prefix ids); equal prefix ids
    mean identical prefix slots, so a step whose classes and segments are the last one's keeps them."""
    dev = torch.device(device)
    i32 = dict(dtype=torch.int32, device=dev)
    out = {"cas_idx": torch.zeros(lim.cascade_slots + lim.cascades + 1, **i32)}
    if lim.scratch:
        out["scratch_k"] = torch.zeros(lim.region_len, num_kv_heads, head_dim, dtype=dtype, device=dev)
        out["scratch_v"] = torch.zeros_like(out["scratch_k"])
        out["g_src"] = torch.zeros(lim.region_len, **i32)
        out["g_dst"] = torch.zeros(lim.region_len, **i32)
    return out


class GraphStep:
    """The prefix paths of one captured batch size (module doc): fixed buffers, ``load`` per step (outside
    the graph), ``run`` per layer (captured). Heads per TP rank; the KV pool is SGLang's / the engine's
    ``[C, Hkv, D]`` per layer, its slot table ``[R, W]`` (request r's slots are row r's first entries).
    ``shared``: :func:`shared_buffers` of the backend (None: this step's own)."""

    def __init__(self, lim: GraphLimits, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, sm_scale: float, backend: str = "auto",
                 workspace: Optional[torch.Tensor] = None, shared: Optional[dict] = None):
        self.lim = lim
        self.hq, self.hkv, self.d, self.dtype, self.sm_scale = num_q_heads, num_kv_heads, head_dim, dtype, sm_scale
        dev = self.device = torch.device(device)
        b, c = lim.batch, lim.cascades
        ws = workspace if workspace is not None else fo.workspace(dev)
        i32 = dict(dtype=torch.int32, device=dev)
        # every per-step array in ONE device buffer (one copy per step): perm | src | kind | skip | count | live
        self.meta = torch.zeros(4 * b + 2, **i32)
        self.perm, self.src, self.kind, self.skip, self.count, self.live = self.meta.split([b, b, b, b, 1, 1])
        self.staging = PinnedStaging(self.meta.numel(), dev)
        self.launches = [HotBatch(ws, num_q_heads, num_kv_heads, head_dim, dtype, sm_scale, backend,
                                  max_segments=lim.dense_segments) for _ in lim.folds]
        sh = shared if shared is not None else shared_buffers(lim, num_kv_heads, head_dim, dtype, dev)
        if sh["cas_idx"].numel() < lim.cascade_slots + c + 1 or (lim.scratch and sh["g_src"].numel() < lim.region_len):
            raise ValueError("GraphStep.shared: buffers smaller than this step's limits; make them with shared_buffers")
        self.shared = sh
        self.cas_idx = sh["cas_idx"]
        self.cascade = fo.make_prefill_paged_wrapper(ws, {
            "qo_indptr": torch.zeros(c + 2, **i32), "indptr": torch.zeros(c + 2, **i32), "indices": self.cas_idx,
            "last_page_len": torch.ones(c + 1, **i32)})
        self.scratch_k, self.scratch_v = sh.get("scratch_k"), sh.get("scratch_v")
        self.g_src, self.g_dst = sh.get("g_src"), sh.get("g_dst")
        self._planned: list = [None] * (len(lim.folds) + 1)      # each launch's last segments (re-plan on change)
        self.plan_: Optional[GraphStepPlan] = None

    def load(self, p: GraphStepPlan, slot_table: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """Write step ``p`` into the buffers the captured ``run`` reads (host + async device work, no sync);
        the plan object loaded last time again: only what another step may have overwritten since.
        ``slot_table`` int32 [R, W] (SGLang's req_to_token), ``req_pool_indices`` [>= B] each row's table row."""
        lim = self.lim
        again = p is self.plan_                 # the last step's plan (a batch whose classes did not change)
        if not again:
            self.staging.write(p.perm + p.src + p.kind + p.skip + [sum(g[1] for g in p.gather), int(p.split)],
                               self.meta)
        rows = req_pool_indices[:lim.batch]
        n = p.cas_kv[-1]
        key = (id(self), tuple(p.cas_kv), p.cas_ids, tuple(g[1:] for g in p.gather), p.gather_ids)
        fresh = key != self.shared.get("key")
        if fresh:
            self._slot_lists(slot_table, rows, p.cas_rows, p.cas_kv, None, self.cas_idx[:n])
        if p.gather and fresh:          # HydraGen: (slot, scratch row) pairs of every gathered prefix
            off = [0]
            for _, lp, _ in p.gather:
                off.append(off[-1] + lp)
            self._slot_lists(slot_table, rows, [g[0] for g in p.gather], off, None, self.g_src[:off[-1]])
            dst = torch.tensor([g[2] for g in p.gather], dtype=torch.int64)          # [G] scratch offsets
            self._slot_lists(None, None, None, off, dst, self.g_dst[:off[-1]])
        self.shared["key"] = key
        if again:
            return
        for i, (hb, hp) in enumerate(zip(self.launches, p.dense)):
            key = (hp.qo_indptr, hp.kv_indptr)
            if key != self._planned[i]:
                hb.plan(hp)
                self._planned[i] = key
        key = (tuple(p.cas_qo), tuple(p.cas_kv))
        if key != self._planned[-1]:
            fo.plan_prefill_paged(self.cascade, torch.tensor(p.cas_qo, dtype=torch.int32),
                                  torch.tensor(p.cas_kv, dtype=torch.int32), self.cas_idx[:n], self.hq, self.hkv,
                                  self.d, causal=False, sm_scale=self.sm_scale, q_dtype=self.dtype, kv_dtype=self.dtype)
            self._planned[-1] = key
        self.plan_ = p

    def _slot_lists(self, table, rows, seg_rows, indptr, base, out) -> None:
        """Into ``out`` [nnz]: segment s's entries at ``indptr[s]:indptr[s+1]`` are the slot table row of batch
        row ``seg_rows[s]`` from column 0 (table given), or ``base[s] + 0, 1, ...`` (base given); nnz =
        indptr[-1], known on the host: a few launches, no sync."""
        nnz = indptr[-1]
        if nnz == 0:
            return
        ip = torch.tensor(indptr, dtype=torch.int64)
        lens = ip.diff()
        if table is not None:
            r = rows.index_select(0, torch.tensor(seg_rows, dtype=torch.int64).to(self.device, non_blocking=True))
            start = r.long() * table.shape[1] - ip[:-1].to(self.device, non_blocking=True)       # [S]
        else:
            start = (base - ip[:-1]).to(self.device, non_blocking=True)
        flat = arange(nnz, self.device) + torch.repeat_interleave(start, lens.to(self.device, non_blocking=True),
                                                                  output_size=nnz)           # [nnz]
        if table is not None:
            out.copy_(table.view(-1).index_select(0, flat))
        else:
            out.copy_(flat)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor) -> None:
        """One layer, in place: q [B, Hq, D]; k_cache / v_cache [C, Hkv, D]; o [B, Hq, D] / lse [B, Hq] (fp32,
        base 2) the rest decode's state, merged with each split row's prefix state."""
        folded = max(self.lim.folds)
        qp, qn = gather_q(q, self.perm, folded, self.live)        # [B, Hq, D], [B, folded*Hq, D] (one launch)
        kd, vd = k_cache, v_cache
        if self.lim.scratch:
            gather_rows(self.scratch_k, k_cache, self.g_dst, self.g_src, self.count)
            gather_rows(self.scratch_v, v_cache, self.g_dst, self.g_src, self.count)
            kd, vd = self.scratch_k, self.scratch_v
        outs_o, outs_l = [], []
        for f, hb in zip(self.lim.folds, self.launches):
            qf = qp if f == 1 else qn if f == folded else qp.repeat(1, f, 1)
            od, ld = hb.run_folded(qf, kd, vd)                    # [B, f*Hq, D], [B, f*Hq]: f sub-states per head
            outs_o.append(od)
            outs_l.append(ld)
        oc, lc = self.cascade.run(qp, fo.paged(k_cache, v_cache), return_lse=True)
        outs_o.append(oc)
        outs_l.append(lc)
        merge_rows(o, lse, outs_o, outs_l, self.kind, self.src, folds=[*self.lim.folds, 1])   # the folds merged too
