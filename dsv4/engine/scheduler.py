"""Continuous batching with chunked prefill under a token budget, prefix-hit replay planning
and preemption by recompute.

Each step: running requests first (in precedence order), each advancing by up to the
remaining budget (a decode is one token); then waiting requests are admitted while slots,
blocks and budget last. When a running request cannot get a block, the lowest-precedence
running request not yet scheduled this step is preempted: all its blocks and its slot are
freed and it goes back to the front of the queue, to be recomputed (its full blocks usually
come straight back from the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.cache.manager import KVCacheManager
from dsv4.config import EngineConfig, ModelConfig
from dsv4.engine.request import Request, Status


@dataclass
class Chunk:
    """Tokens [start, start + num_tokens) of a request computed this step."""

    req: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the last known token, so the step samples the next one."""
        return self.start + self.num_tokens == self.req.num_tokens


class Scheduler:
    def __init__(self, engine_cfg: EngineConfig, model_cfg: ModelConfig, manager: KVCacheManager):
        self.cfg, self.model_cfg, self.manager = engine_cfg, model_cfg, manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.preemptions = 0

    # ------------------------------------------------------------------------ bookkeeping
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Finished or aborted: release every block and the slot."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self.manager.free(req.request_id)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.slot = None
        self.requests.pop(req.request_id, None)

    def _key(self, req: Request) -> tuple:
        """Precedence: preempted requests resume first, then priority (lower first, under the
        priority policy), then arrival."""
        priority = req.priority if self.cfg.scheduling_policy == "priority" else 0
        return (0 if req.num_preemptions else 1, priority, req.arrival)

    def _preempt(self, victim: Request) -> None:
        self.manager.free(victim.request_id)
        self.running.remove(victim)
        victim.status = Status.WAITING
        victim.slot = None
        victim.num_preemptions += 1
        self.waiting.append(victim)
        self.preemptions += 1

    # ------------------------------------------------------------------------- planning
    def _plan_admission(self, req: Request, hit: int) -> None:
        """Decide what the request computes after a prefix hit of `hit` tokens.

        The hit brings global KV only; window rings must be rebuilt by replaying tokens
        before the hit. Bounded replay (default, the authors' method, approximate) replays
        the last `window` tokens with the window truncated at the replay start. Exact mode
        replays the whole dependency cone, num_layers * (window - 1) tokens: a layer's window
        output is exact once its input is exact over the preceding window - 1 positions, so
        every layer's ring at the hit is bit-identical to a cold run (we recompute rather
        than store per-block ring snapshots: 2.7 MB of rings per block boundary would cost
        more memory than the global KV itself). V4.1's decoder layers, under bounded replay,
        run only on the last `window` known tokens."""
        m, w = self.model_cfg, self.model_cfg.window
        total = req.num_tokens
        if hit == 0:
            start = 0
        elif self.cfg.swa_bounded_replay:
            start = max(0, hit - w)
        else:
            start = max(0, hit - m.num_layers * (w - 1))
        req.prefill_target = total
        req.num_cached_tokens = hit
        req.num_computed = start
        req.emit_from = hit
        req.window_floor = start
        bounded_decoder = m.ced_split is not None and self.cfg.swa_bounded_replay and req.params.prompt_logprobs is None
        req.full_decoder = not bounded_decoder
        req.decoder_start = max(start, total - w) if bounded_decoder else start
        req.decoder_floor = req.decoder_start

    def _sibling_ready(self, req: Request) -> bool:
        """n > 1: later samples wait until the first sample's prompt is in the prefix cache,
        then share its blocks through a hit."""
        if req.wait_for is None or not self.cfg.enable_prefix_caching:
            return True
        first = self.requests.get(req.wait_for)
        return first is None or first.status == Status.RUNNING and first.num_computed >= len(first.prompt_token_ids)

    # ---------------------------------------------------------------------------- step
    def schedule(self) -> list[Chunk]:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[Chunk] = []
        scheduled: set[str] = set()
        for req in sorted(self.running, key=self._key):
            if budget == 0:
                break
            if req.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._reserve(req, min(req.num_tokens - req.num_computed, budget), scheduled)
            if n == 0:
                self._preempt(req)  # nothing fits even alone: free it, retry from the queue
                continue
            chunks.append(Chunk(req, req.num_computed, n))
            scheduled.add(req.request_id)
            budget -= n

        prefix_loads = 0
        for req in sorted(self.waiting, key=self._key):
            if budget == 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            if not self._sibling_ready(req):
                continue
            slot = self.manager.allocate_slot(req.request_id)
            if slot is None:
                break
            # prompt logprobs need logits at every prompt position: no prefix hit for those
            lookup = [] if req.params.prompt_logprobs is not None else req.all_token_ids
            _, hit = self.manager.get_computed_blocks(req.request_id, lookup, req.cache_salt)
            cap = self.cfg.max_prefix_loads_per_step
            if hit and cap is not None and prefix_loads >= cap:
                self.manager.free(req.request_id)
                continue
            self._plan_admission(req, hit)
            n = min(req.num_tokens - req.num_computed, budget)
            if not self.manager.allocate_for(req.request_id, req.num_computed + n):
                self.manager.free(req.request_id)
                break
            prefix_loads += bool(hit)
            req.slot = slot
            req.status = Status.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            chunks.append(Chunk(req, req.num_computed, n))
            budget -= n
        return chunks

    def _reserve(self, req: Request, n: int, scheduled: set[str]) -> int:
        """Blocks for `n` more tokens of a running request, preempting lower-precedence
        requests not yet scheduled this step if needed; with no victim left, shrink the
        chunk to what the free blocks cover. -> tokens reserved (0: none)."""
        while not self.manager.allocate_for(req.request_id, req.num_computed + n):
            victims = [r for r in self.running if r is not req and r.request_id not in scheduled]
            if victims:
                self._preempt(max(victims, key=self._key))
                continue
            bs = self.manager.block_size
            covered = (len(self.manager.block_table(req.request_id)) + self.manager.blocks_available) * bs
            n = min(n, covered - req.num_computed)
            if n <= 0:
                return 0
        return n

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
