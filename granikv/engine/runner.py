"""Prefill and decode forwards over the KV cache, with CUDA graphs for decode (SGLang-style padding).

Prefill (extend): the new tokens of one or more requests as one ragged batch; each layer writes
their K/V to the requests' slots, then ATTN's :class:`PrefillAttention` attends causally over
each request's slots (cached prefix first). Tokens matched in the prefix index are not part of
the batch, so they are never recomputed.

Decode: one token per running request. The slot table ``rows x max_len`` (SGLang's
req_to_token) lives on the device; each step hands the decode attention (granikv.attention.decode)
the table and the batch's rows, and its plan (once per step, outside any graph) gathers the slot
lists its kernels read in one pass with no host sync (every system alike, as SGLang builds its
``kv_indices`` from req_to_token inside its plan), then the model runs per layer. Batches up to
``cuda_graph_max_bs`` are padded to the next captured size (pad rows are 1-token rows on one
scratch slot, as in SGLang; for every policy that splits prefix classes off (all but ``paged``), pad
rows join the batch's single prefix class when there is one:
the batch-global cascade needs a prefix common to every row, and a class covering the whole padded
batch keeps the graph key a function of the padded size and the other policies on their no-gather
full-cover path; policies decide on real rows only, ``DecodeBatch.num_pad``).

Graph keying lives here: a step's CUDA graph is keyed by (padded size, the attention's
``graph_key(step)``) and captured lazily; larger batches, CPU runs and attention that declares
``graph_safe = False`` run eagerly (loaded with ``graph=False``: one eager wrapper set). A key
holding split-off prefix classes is captured at its ``capture_at``-th step and runs eagerly before
(reason ``new_step_structure``): under eviction a multi-prefix batch changes structure almost every
step, and capturing each once-seen structure costs far more than running it eagerly.

Step kind: before planning a decode step the runner tells the attention's policy whether the step
is a graph step (``policy.graph_step``; True when it is padded to a captured size and nothing rules a
graph out) or an eager one (above ``cuda_graph_max_bs``, attention not graph-safe, unpadded runs), so
granikv's dispatcher follows the table's rules for that kind. A graph-kind step that runs eagerly
because its structure is not captured yet (``new_step_structure``) keeps the graph-kind decisions:
its plan is the one that will be captured.
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections import OrderedDict

import torch

from granikv.attention.batch import DecodeBatch, host_i64, to_device
from granikv.attention.plan import StepPlan
from granikv.engine.model import CausalLM
from granikv.engine.scheduler import PrefillChunk, Seq, Storage
from granikv.kv import KVCache

# What a decode step's recorded ``plan_us`` covers (the cell records it: engine stats
# ``decode_plan_scope``): gathering the step's slot lists from the slot table, the policy's choices
# and the attention's kernel plans, for every system (SGLang's init_forward_metadata covers the same:
# its kv_indices are built from req_to_token there). Cells without the key timed the plan alone,
# after the full slot lists had been gathered.
PLAN_SCOPE = "gather+plan"


def graph_sizes(max_bs: int) -> list[int]:
    """Decode batch sizes to capture (SGLang's list shape: 1, 2, 4, 8, 12, 16, 24, then every 8)."""
    sizes = [1, 2, 4, 8, 12, 16, 24] + list(range(32, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | ({max_bs} if max_bs else set()))


class LogitProbe:
    """Keeps fp32 decode logits of the first ``rows`` requests (by rid) for the first ``steps`` decode steps.

    ``kept[(rid, k)]`` = logits ``[V]`` (CPU) that produced request ``rid``'s output token ``k``
    (k >= 1; token 0 comes from prefill). For comparing systems' numerics on the GPU.
    """

    def __init__(self, rows: int, steps: int):
        self.rows, self.steps, self.kept = rows, steps, {}
        self._n = 0

    def keep(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        if self._n >= self.steps:
            return
        self._n += 1
        pick = [(i, s) for i, s in enumerate(seqs) if s.req.rid < self.rows]
        if pick:
            got = logits[torch.tensor([i for i, _ in pick], device=logits.device)].float().cpu()
            for j, (_, s) in enumerate(pick):
                self.kept[(s.req.rid, s.issued)] = got[j]       # tokens launched before this step


class PendingTokens:
    """A decode step's next tokens: ``[n]`` on the device, copied to pinned host memory in flight.

    ``get()`` waits for that copy only (a CUDA event recorded after it), not for work queued later
    on the stream, so the overlap schedule can launch step t+1 before reading step t's tokens."""

    def __init__(self, toks: torch.Tensor):
        if toks.is_cuda:
            self.host = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True)
            self.host.copy_(toks, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = toks, None

    def get(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class _WriteThen:
    """The model's attention hook: write this step's K/V at ``slots`` ``[n]``, then run ``attend``."""

    def __init__(self, kv: KVCache, slots: torch.Tensor, attend):
        self.kv, self.slots, self.attend = kv, slots, attend

    def __call__(self, layer, q, k, v):
        self.kv.write(layer, self.slots, k, v)
        return self.attend.run(q, self.kv.k(layer), self.kv.v(layer))


class ModelRunner:
    """Runs prefill batches and decode batches of :class:`Seq` s through the model.

    ``use_graphs``: capture CUDA graphs (GPU only); ``pad``: pad decode batches to captured
    sizes (forced on with graphs; settable on CPU so the padding path is testable).
    """

    def __init__(self, model: CausalLM, kv: KVCache, storage: Storage, backend, prefill_attn,
                 max_rows: int, max_len: int, cuda_graph_max_bs: int, use_graphs: bool, pad: bool,
                 max_graphs: int = 0, capture_at: int = 1):
        self.model, self.kv, self.storage = model, kv, storage
        self.backend, self.prefill_attn = backend, prefill_attn
        self.device = kv.device
        self.use_graphs = use_graphs and self.device.type == "cuda" and cuda_graph_max_bs > 0
        self.pad = pad or self.use_graphs
        self.sizes = graph_sizes(cuda_graph_max_bs) if self.pad else []
        self.pad_row = max_rows           # table row of a 1-token pad request: [pad slot]
        self.pad_class_row = max_rows + 1  # pad rows inside the batch's one prefix class: [prefix slots, pad slot]
        self.pad_into_class = backend.policy.splits
        self._pad_class = None            # Seq.order of the request whose prefix pad_class_row holds
        self.table = torch.zeros(max_rows + 2, max_len, dtype=torch.int64, device=self.device)  # [rows+2, max_len]
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()  # (padded bs, graph key) -> (graph, logits), LRU order
        self.max_graphs = max_graphs      # 0 = keep every captured graph
        self.graphs_captured = 0          # captures so far (evicted ones included)
        self.graphs_evicted = 0
        self.graph_pool = None
        # capture policy: a graph key with split-off prefix classes is captured at its capture_at-th
        # step (eager before); sightings per (padded bs, graph key), bounded, oldest forgotten first
        self.capture_at = capture_at
        self._sightings: OrderedDict[tuple, int] = OrderedDict()
        # every graph writes its logits into this one buffer (steps run one at a time and the logits are
        # consumed before the next launch): a graph-private output each, [bs, V] fp32 (131 MB at bs=256,
        # Llama-3.1-8B), pinned ~15 GiB across hundreds of multi-prefix graphs (H200, 2026-11-30)
        self.logits_buf: torch.Tensor | None = None
        self._capture_stream = None
        self.capture_s = 0.0
        self.eager_reasons: dict[str, int] = {}
        self.logit_probe: LogitProbe | None = None  # set by benchmarks to keep some decode logits
        n = max(self.sizes, default=1)
        # latest token per table row (decode input ids are gathered from it on the device, so a step
        # can be launched before the previous step's tokens reach the host); pad rows stay 0
        self.last_tok = torch.zeros(max_rows + 2, dtype=torch.int64, device=self.device)
        self._plan_copied = None          # CUDA event after the last decode plan's host->device copies
        self.ids_buf = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.pos_buf = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.slot_buf = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.reset()

    def reset(self) -> None:
        self.table[self.pad_row, 0] = self.storage.pad_slot
        self.last_tok.zero_()
        self._pad_class = None

    def resize(self, max_len: int) -> None:
        """Make the slot table at least ``max_len`` wide (per run; captured graphs do not read it)."""
        if self.table.shape[1] < max_len:
            self.table = torch.zeros(self.table.shape[0], max_len, dtype=torch.int64, device=self.device)
        self.reset()

    def set_row(self, s: Seq) -> None:
        self.table[s.row, :s.slots.numel()] = s.slots

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk]) -> list[int | None]:
        """Compute the chunks' KV; returns the first output token of each chunk that ends its prompt."""
        dev = self.device
        ids, pos, qo, kvp, new_slots, kv_idx = [], [], [0], [0], [], []
        for c in chunks:
            ids.extend(c.seq.req.prompt_ids[c.start:c.end])
            pos.append(torch.arange(c.start, c.end))
            qo.append(qo[-1] + c.end - c.start)
            kvp.append(kvp[-1] + c.end)
            w = c.seq.slots[c.start:c.end]
            if c.start < c.seq.cached_len:  # a recomputed cached token (full hit): keep the shared KV intact
                w = w.clone()
                w[:c.seq.cached_len - c.start] = self.storage.pad_slot
            new_slots.append(w)
            kv_idx.append(c.seq.slots[:c.end])
        # indptrs stay on the host: FlashInfer's plan() reads them there (no device->host sync) and
        # copies them to its device buffers itself; the slot ids are on the device already
        self.prefill_attn.plan(torch.tensor(qo, dtype=torch.int32), torch.tensor(kvp, dtype=torch.int32),
                               torch.cat(kv_idx))
        hook = _WriteThen(self.kv, torch.cat(new_slots), self.prefill_attn)
        h = self.model(torch.tensor(ids, dtype=torch.int64, device=dev), torch.cat(pos).to(dev), hook)
        last = [i for i, c in enumerate(chunks) if c.end == c.seq.prompt_len]
        out: list[int | None] = [None] * len(chunks)
        if last:
            rows = torch.tensor([qo[i + 1] - 1 for i in last], device=dev)
            toks_d = self.model.logits(h[rows]).argmax(-1)
            self.last_tok[torch.tensor([chunks[i].seq.row for i in last], device=dev)] = toks_d
            for i, t in zip(last, toks_d.tolist()):
                out[i] = t
        return out

    # ------------------------------------------------------------------ decode
    def _decode_batch(self, seqs: list[Seq], bs: int) -> tuple[DecodeBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """DecodeBatch of ``bs`` rows (pad rows after the real ones), with ids, positions and table rows [bs]."""
        dev, npad = self.device, bs - len(seqs)
        pos = [s.prompt_len + s.issued - 1 for s in seqs]          # the last launched token's position
        rows = [s.row for s in seqs]
        lp, pid, hs = [s.req.shared_len for s in seqs], [s.prefix_id for s in seqs], [s.hot_start for s in seqs]
        s0 = seqs[0]
        if npad and self.pad_into_class and s0.prefix_id >= 0 and all(p == s0.prefix_id for p in pid):
            # Pad rows join the one class (see the module doc): they read the prefix once more on the
            # class's path (skipped when it goes paged), and write only the scratch slot.
            if self._pad_class != s0.order:
                self.table[self.pad_class_row, :s0.req.shared_len] = s0.slots[:s0.req.shared_len]
                self.table[self.pad_class_row, s0.req.shared_len] = self.storage.pad_slot
                self._pad_class = s0.order
            pos += [s0.req.shared_len] * npad
            rows += [self.pad_class_row] * npad
            lp, pid, hs = lp + [lp[0]] * npad, pid + [pid[0]] * npad, hs + [hs[0]] * npad
        else:  # SGLang's padding: 1-token rows on a scratch slot
            pos += [0] * npad
            rows += [self.pad_row] * npad
            lp, pid, hs = lp + [0] * npad, pid + [-1] * npad, hs + [-1] * npad
        indptr = list(itertools.accumulate((p + 1 for p in pos), initial=0))
        # one host->device copy: [indptr (bs+1) | rows (bs) | pos (bs)]
        packed_h = host_i64(indptr + rows + pos)
        packed = to_device(packed_h, dev)                           # async (pinned)
        indptr_d, rows_d, pos_d = packed.split([bs + 1, bs, bs])
        ids_d = self.last_tok[rows_d]                               # [bs] input ids (pad rows: 0)
        # the slot lists stay in the table: the attention's plan gathers the ones its kernels read
        batch = DecodeBatch(kv_indptr=indptr_d, kv_indices=None, prefix_lens=lp, prefix_ids=pid, hot_starts=hs,
                            kv_indptr_host=packed_h[:bs + 1], num_pad=npad, slot_table=self.table,
                            slot_rows=packed_h[bs + 1:2 * bs + 1])
        return batch, ids_d, pos_d, rows_d

    @torch.inference_mode()
    def decode(self, seqs: list[Seq]) -> tuple[PendingTokens, dict]:
        """Launch one token for each seq; returns (its tokens, in flight to the host; info: padded
        size, graph used, eager reason). The tokens also go to ``last_tok`` on the device."""
        n = len(seqs)
        i = bisect.bisect_left(self.sizes, n)
        bs = self.sizes[i] if self.pad and i < len(self.sizes) else n
        batch, ids, pos, rows = self._decode_batch(seqs, bs)
        pad_class = batch.prefix_ids[-1] if bs > n else -1
        slots = self.table[rows, pos]                        # [bs] where this step's K/V go
        info = {"padded_bs": bs, "graph": False, "pad_class": pad_class}
        reason = None                                        # why a graph-shaped step runs eagerly
        if self.sizes and n > self.sizes[-1]:
            reason = "above_cuda_graph_max_bs"
        elif not getattr(self.backend, "graph_safe", False):
            reason = f"backend_{getattr(self.backend, 'name', '?')}_not_graph_safe"
        # graph=False: no graph of this step will be replayed -> the backend's one eager wrapper set
        # (a padded CPU run plans exactly as the GPU run would: graph=True where it would replay)
        if self._plan_copied is not None:
            # overlap schedule: FlashInfer's plan() refills pinned host buffers and copies them to the
            # device asynchronously; the previous step's copies must have run before they are overwritten
            self._plan_copied.synchronize()
        t_plan = time.perf_counter()
        graph = bool(self.pad and self.sizes) and reason is None
        # the step kind the policy decides for (granikv's table may hold separate eager rules): eager
        # when it can never replay (above the graph limit, attention not graph-safe, no graph sizes)
        self.backend.policy.graph_step = graph
        step = self.backend.make_plan(batch)
        if graph and self.capture_at > 1:
            graph = self._graph_ready(self._graph_key(bs, step), step)
            if not graph:
                reason = "new_step_structure"   # seen fewer than capture_at times
        self.backend.load(step, graph=graph)
        info["plan_us"] = (time.perf_counter() - t_plan) * 1e6
        info["dispatch_us"] = getattr(self.backend, "last_choose_us", 0.0)
        if self.device.type == "cuda":
            self._plan_copied = torch.cuda.Event()
            self._plan_copied.record()
        if not self.use_graphs:
            reason = None
        if self.use_graphs and reason is None:
            logits = self._replay(self._graph_key(bs, step), ids, pos, slots)
            info["graph"] = True
        else:
            if reason is not None:
                self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
                info["eager_reason"] = reason
            h = self.model(ids, pos, _WriteThen(self.kv, slots, self.backend))
            logits = self.model.logits(h)
        if self.logit_probe is not None:
            self.logit_probe.keep(seqs, logits[:n])
        toks = logits[:n].argmax(-1)
        self.last_tok[rows[:n]] = toks
        return PendingTokens(toks), info

    def _graph_key(self, bs: int, step: StepPlan) -> tuple:
        """Which steps share a CUDA graph: (padded batch size, the attention's graph key of ``step``)."""
        return (bs, self.backend.graph_key(step))

    def _graph_ready(self, key: tuple, step: StepPlan) -> bool:
        """Capture policy, asked between make_plan() and load() with this step's graph key: True =
        replay (or capture) a graph of it now; False = run it eagerly. Keys of the batch size alone,
        and keys already captured, are always ready; a key with split-off classes at its
        ``capture_at``-th step."""
        if key in self.graphs or not step.split:
            return True
        n = self._sightings.pop(key, 0) + 1
        if n >= self.capture_at:
            return True                   # captured now; an evicted graph counts its sightings again
        self._sightings[key] = n
        if len(self._sightings) > 8192:   # bounded: forget the least recently seen structures
            self._sightings.popitem(last=False)
        return False

    def _replay(self, key: tuple, ids, pos, slots) -> torch.Tensor:
        """Replay the graph of ``key`` (a ``_graph_key``: padded size first), capturing it first if new."""
        bs = key[0]
        self.ids_buf[:bs].copy_(ids)
        self.pos_buf[:bs].copy_(pos)
        self.slot_buf[:bs].copy_(slots)
        if key not in self.graphs:
            self._evict_for_capture()
            t0 = time.perf_counter()
            hook = _WriteThen(self.kv, self.slot_buf[:bs], self.backend)
            ids_v, pos_v = self.ids_buf[:bs], self.pos_buf[:bs]
            if self._capture_stream is None:  # one side stream: blocks cached per stream are not shared
                self._capture_stream = torch.cuda.Stream()
            stream = self._capture_stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph (writes the same K/V twice)
                self.model.logits(self.model(ids_v, pos_v, hook))
            torch.cuda.current_stream().wait_stream(stream)
            if self.logits_buf is None:       # [max graph bs, V] fp32, the output of every graph
                n_max = max(self.sizes)
                self.logits_buf = torch.empty(n_max, self.model.vocab_local * self.model.tp.size, dtype=torch.float32,
                                              device=self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.graph_pool):
                out = self.model.logits(self.model(ids_v, pos_v, hook), out=self.logits_buf[:bs])
            if self.graph_pool is None:
                self.graph_pool = g.pool()
            self.graphs[key] = (g, out)
            self.graphs_captured += 1
            torch.cuda.synchronize()
            self.capture_s += time.perf_counter() - t0
        self.graphs.move_to_end(key)
        g, out = self.graphs[key]
        g.replay()
        return out

    def _evict_for_capture(self) -> None:
        """Make room for one more graph: drop the least recently replayed ones (and the wrapper sets
        they pinned) down to ``max_graphs - 1``. The graphs share one memory pool, so a dropped
        graph's activations are reused by the next capture."""
        if self.max_graphs and len(self.graphs) >= self.max_graphs and self.device.type == "cuda":
            torch.cuda.synchronize()      # no replay of a graph about to be destroyed is in flight
        while self.max_graphs and len(self.graphs) >= self.max_graphs:
            (_, gkey), _ = self.graphs.popitem(last=False)
            if gkey is not None and hasattr(self.backend, "release_graph"):
                self.backend.release_graph(gkey)
            self.graphs_evicted += 1
        if not self.graphs:
            self.graph_pool = None        # freed with its last graph; the next capture starts a new pool

    def drop_graphs(self) -> None:
        """Forget every captured graph (and the wrapper sets they pinned); the next decode recaptures.
        The shared memory pool goes with them: capturing into a pool whose graphs are all gone trips
        an internal assert of torch's caching allocator (seen 2026-11-30)."""
        if self.graphs and self.device.type == "cuda":
            torch.cuda.synchronize()
        for (_, gkey) in list(self.graphs):
            if gkey is not None and hasattr(self.backend, "release_graph"):
                self.backend.release_graph(gkey)
        self.graphs = OrderedDict()
        self.graph_pool = None
