"""The synchronous engine: requests in, one scheduler step at a time, outputs out.

`LLMEngine.step()` = schedule -> run the model on one flat batch -> sample on the device ->
update streams (detokenise, stop strings) -> commit completed blocks to the prefix cache ->
free finished requests. The async server and the offline `LLM` both drive this loop.

With async scheduling (`EngineConfig.async_scheduling`, on by default where steps replay CUDA
graphs) the host builds and launches step N+1 before it reads step N's tokens, so its work —
scheduling, the step's metadata, detokenising, stop checks — overlaps the GPU's instead of
leaving it idle between steps (vLLM's `--async-scheduling`). The token sampled at step N is a
placeholder in its request until then (`runner.pending_token`): the next forward takes it
from the device (`runner.PendingTokens`), the host from `_collect`. `step()` then returns the
previous step's outputs; the tokens are the same as with synchronous scheduling.
"""

from __future__ import annotations

import itertools
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4.cache.manager import KVCacheManager, plan_capacity
from dsv4.cache.storage import KVCacheStorage
from dsv4.config import EngineConfig, load_config
from dsv4.engine.cuda_graphs import DEFAULT_SIZES, REQUEST_SIZES, ROW_SIZES, DecodeGraphs, PiecewiseGraphs
from dsv4.engine.detokenizer import RequestStream, TokenBytes
from dsv4.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from dsv4.engine.request import Request, Status
from dsv4.engine.runner import ModelRunner, PendingTokens, StepLogits, pending_token
from dsv4.engine.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    compute_prompt_logprobs,
    make_generator,
)
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import Chunk, Scheduler
from dsv4.model.model import Model
from dsv4.model.tokenizer import engram_token_map, load_tokenizer
from dsv4.model.weights import load_weights

CPU_DEFAULT_KV_MEMORY = 512 << 20


@dataclass
class _Launched:
    """A step whose forward (and, after `_sample`, sampler) is queued on the device."""

    logits: StepLogits
    sampling: list[Request]  # the requests it samples for, in the sampler's row order
    computed: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, tokens computed, its preemptions then)
    prompt: list[tuple[Request, LogprobsTensors]] = field(default_factory=list)
    sampled: SamplerOutput | None = None


def _kv_budget(cfg: EngineConfig, device: torch.device) -> int:
    if cfg.kv_cache_memory is not None:
        return cfg.kv_cache_memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * cfg.gpu_memory_utilization)
    return CPU_DEFAULT_KV_MEMORY


class LLMEngine:
    def __init__(self, model_dir: str | Path, *, progress: bool = True, **options):
        self.engine_config = cfg = EngineConfig(**options)
        self.model_config = mcfg = dataclasses.replace(load_config(model_dir), fp8_activations=cfg.fp8_activations,
                                                                   fp4_experts=cfg.fp4_experts)
        self.device = torch.device(cfg.device)
        dtype = cfg.torch_dtype
        self.tokenizer = load_tokenizer(model_dir)
        token_map = engram_token_map(self.tokenizer) if mcfg.engram_layer_ids else None
        weights = load_weights(model_dir, mcfg, dtype=dtype, device=self.device, compact=self.device.type == "cuda", progress=progress)
        self.model = Model(mcfg, weights.tensors, dtype=dtype, device=self.device, token_map=token_map, fast_path=cfg.fast_path)
        num_blocks = plan_capacity(mcfg, cfg.block_size, _kv_budget(cfg, self.device), cfg.max_num_seqs, dtype, max_model_len=cfg.max_model_len or cfg.block_size)
        capacity = num_blocks * cfg.block_size
        self.max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, capacity)
        self.storage = KVCacheStorage(mcfg, num_slots=cfg.max_num_seqs, num_blocks=num_blocks, block_size=cfg.block_size, dtype=dtype, device=self.device)
        self.manager = KVCacheManager(mcfg, self.storage, cfg.block_size, num_blocks, cfg.max_num_seqs, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, mcfg, self.manager)
        decode = prefill = None
        if self.model.fast:  # steps padded to buckets; CUDA graphs unless enforce_eager
            below = lambda sizes, top: [s for s in sizes if s < top] + [top]
            use_graphs = self.device.type == "cuda" and not cfg.enforce_eager
            max_blocks = -(-self.max_model_len // cfg.block_size)
            decode = DecodeGraphs(self.model, self.storage, max_blocks=max_blocks, sizes=below(DEFAULT_SIZES, cfg.max_num_seqs), use_graphs=use_graphs)
            decode.capture()
            # prefill graphs are captured on first use of a bucket (there are many)
            prefill = PiecewiseGraphs(self.model, self.storage, max_blocks=max_blocks, row_sizes=below(ROW_SIZES, cfg.max_num_batched_tokens),
                                      request_sizes=below(REQUEST_SIZES, cfg.max_num_seqs), use_graphs=use_graphs)
        self.runner = ModelRunner(self.model, self.storage, self.manager, decode, prefill)
        replays = self.model.fast and self.device.type == "cuda" and not cfg.enforce_eager
        self.async_scheduling = replays if cfg.async_scheduling is None else cfg.async_scheduling
        # async: the tokens sampled for each slot, which the next step's forward reads
        self.pending = PendingTokens(cfg.max_num_seqs, self.device) if self.async_scheduling else None
        self._in_flight: _Launched | None = None
        self.sampler = Sampler(make_generator(cfg.seed, self.device))
        self.token_bytes = TokenBytes(self.tokenizer.backend)
        self._groups: dict[str, list[Request]] = {}
        self._prompts: dict[str, str | None] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._arrivals = itertools.count()

    # ------------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, cache_salt: str | None = None, priority: int = 0, grammar=None, prompt: str | None = None) -> None:
        """Queue a request. `grammar`: a callable returning a fresh GrammarMatcher per sample
        (structured output), or None."""
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_token_ids)} tokens leave no room under max_model_len {self.max_model_len}")
        params.validate()
        room = self.max_model_len - len(prompt_token_ids)
        max_out = room if params.max_tokens is None else min(params.max_tokens, room)
        group = []
        for k in range(params.n):
            sample_params = params
            seed = None if params.seed is None else params.seed + k
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{k}",
                parent_id=request_id,
                index=k,
                prompt_token_ids=list(prompt_token_ids),
                params=sample_params,
                stream=RequestStream(self.token_bytes, params, eos_token_id=self.tokenizer.eos_id, max_output_tokens=max_out),
                priority=priority,
                cache_salt=cache_salt,
                arrival=time.monotonic() + next(self._arrivals) * 1e-9,
                generator=None if seed is None else make_generator(seed, self.device),
                grammar=grammar() if grammar is not None else None,
                wait_for=None if k == 0 else group[0].request_id,
            )
            group.append(req)
            self.scheduler.add(req)
        self._groups[request_id] = group
        self._prompts[request_id] = prompt

    def abort_request(self, request_id: str) -> None:
        for req in self._groups.pop(request_id, []):
            if not req.finished:
                self.scheduler.finish(req)
        self._prompts.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One scheduler step. Synchronous: schedule, run, sample, read the tokens, return
        their outputs. Async scheduling: schedule and launch this step, then read the
        previous step's tokens (their forward ran first; this one runs meanwhile), then queue
        this step's sampling — the outputs returned are the previous step's, and a request
        that finished there has spent one forward of this step for nothing."""
        chunks = self.scheduler.schedule()
        launched = self._launch(chunks) if chunks else None
        if self.pending is None:
            if launched is None:
                return []
            self._sample(launched)
            return self._collect(launched)
        previous, self._in_flight = self._in_flight, None
        outputs = self._collect(previous) if previous is not None else []
        if launched is not None:
            self._sample(launched)
            self._in_flight = launched
        return outputs

    def _launch(self, chunks: list[Chunk]) -> _Launched:
        """Queue the forward of `chunks`, and the prompt logprobs (read the logits before the
        next forward overwrites them); the sampler is queued by `_sample`."""
        logits = self.runner.run(chunks, self.pending)
        step = _Launched(logits, sampling=[c.req for c in chunks if c.samples])
        for c in chunks:
            req = c.req
            if req.request_id in logits.prompt_rows:
                step.prompt.append((req, self._prompt_logprobs(req, c, logits)))
            req.num_computed += c.num_tokens
            if req.num_computed <= req.prefill_target:
                self.prompt_tokens += c.num_tokens
            step.computed.append((req, req.num_computed, req.num_preemptions))
        return step

    def _sample(self, step: _Launched) -> None:
        """Queue the sampler for the step's sampling requests that are still running (under
        async scheduling the previous step's tokens may have finished some). Async: each
        gets a placeholder token, resolved on the device by the next forward and on the host
        by `_collect`."""
        reqs = step.sampling = [r for r in step.sampling if not r.finished]
        if not reqs:
            return
        rows = torch.tensor([step.logits.sample_rows[r.request_id] for r in reqs], device=step.logits.logits.device)
        logits = step.logits.logits[rows]
        masks = [r.grammar.allowed_mask(logits.device) if r.grammar is not None else None for r in reqs]
        batch = SamplingBatch.build(
            [r.params for r in reqs],
            vocab_size=logits.shape[-1],
            device=logits.device,
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            eos_token_id=self.tokenizer.eos_id,
            allowed_token_masks=masks if any(m is not None for m in masks) else None,
        )
        step.sampled = self.sampler.sample(logits, batch)
        if self.pending is not None:
            self.pending.record([r.slot for r in reqs], step.sampled.sampled_token_ids)
            for r in reqs:
                r.output_token_ids.append(pending_token(r.slot))

    def _collect(self, step: _Launched) -> list[RequestOutput]:
        """Read the step's results (waits for its sampler): prompt logprobs, the blocks it
        completed into the prefix cache, each sampled token into its request's stream ->
        the outputs of the requests that got a token."""
        for req, lp in step.prompt:
            self._append_prompt_logprobs(req, lp)
        for req, computed, preemptions in step.computed:
            # (async) a request preempted since has lost the blocks this step wrote
            if req.status == Status.RUNNING and req.num_preemptions == preemptions:
                self.manager.commit_full_blocks(req.request_id, req.all_token_ids[:computed])
        out = step.sampled
        if out is None:
            return []
        tokens = out.sampled_token_ids.tolist()
        changed: dict[str, None] = {}
        now = time.monotonic()
        for i, (req, tok) in enumerate(zip(step.sampling, tokens)):
            if self.pending is not None:
                req.output_token_ids[-1] = tok  # the placeholder `_sample` appended (still the newest token)
            else:
                req.output_token_ids.append(tok)
            if req.finished:  # aborted while the step ran
                continue
            self._advance(req, tok, i, out, now)
            changed[req.parent_id] = None
        return [self._output(pid) for pid in changed]

    def _advance(self, req: Request, tok: int, row: int, out, now: float) -> None:
        """Account the request's new token `tok` (row `row` of the sampler output `out`):
        logprobs, text and stop conditions; finish the request if it stops here."""
        self.generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if req.params.logprobs is not None and out.logprobs is not None:
            n = req.params.logprobs
            ids = out.logprobs.token_ids[row].tolist()
            vals = out.logprobs.logprobs[row].tolist()
            req.logprobs.append(TokenLogprob(tok, vals[0], int(out.logprobs.ranks[row]), list(zip(ids[1 : 1 + n], vals[1 : 1 + n]))))
        delta = req.stream.append(tok)
        req.text_delta += delta.text
        req.stop_reason = delta.stop_reason
        finished = delta.finish_reason is not None
        if not finished and req.grammar is not None:
            req.grammar.accept(tok)
            if req.grammar.is_terminated():  # only EOS could follow: stop here
                req.text_delta += req.stream.finish("stop").text
                finished = True
        if not finished and req.num_tokens >= self.max_model_len:
            req.text_delta += req.stream.finish("length").text
            finished = True
        req.new_token_ids.append(tok)
        if finished:
            self.scheduler.finish(req)

    def _prompt_logprobs(self, req: Request, chunk: Chunk, step: StepLogits) -> LogprobsTensors:
        first, count = step.prompt_rows[req.request_id]
        targets = torch.tensor(req.prompt_token_ids[chunk.start + 1 : chunk.start + 1 + count], device=step.logits.device)
        return compute_prompt_logprobs(step.logits[first : first + count], targets, req.params.prompt_logprobs)

    def _append_prompt_logprobs(self, req: Request, lp: LogprobsTensors) -> None:
        n = req.params.prompt_logprobs
        for i in range(lp.ranks.shape[0]):
            ids, vals = lp.token_ids[i].tolist(), lp.logprobs[i].tolist()
            req.prompt_logprobs.append(TokenLogprob(ids[0], vals[0], int(lp.ranks[i]), list(zip(ids[1 : 1 + n], vals[1 : 1 + n]))))

    def _output(self, parent_id: str) -> RequestOutput:
        group = self._groups[parent_id]
        outs = []
        for req in group:
            reason = req.stream.finish_reason
            outs.append(CompletionOutput(
                index=req.index,
                text=req.stream.text,
                token_ids=list(req.output_token_ids),
                finish_reason=reason,
                stop_reason=req.stop_reason,
                logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
                text_delta=req.text_delta,
                token_ids_delta=req.new_token_ids,
            ))
            req.text_delta, req.new_token_ids = "", []
        first = group[0]
        result = RequestOutput(
            request_id=parent_id,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outs,
            num_cached_tokens=first.num_cached_tokens,
            prompt_logprobs=[None] + first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            prompt=self._prompts.get(parent_id),
        )
        if result.finished:
            self._groups.pop(parent_id, None)
            self._prompts.pop(parent_id, None)
        return result

    # --------------------------------------------------------------------------- stats
    def stats(self) -> dict:
        m, s = self.manager, self.scheduler
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "kv_usage": m.usage(),
            "blocks_total": m.blocks_total,
            "blocks_used": m.blocks_used,
            "blocks_cached_free": m.blocks_cached_free,
            "slots_free": m.num_free_slots,
            "capacity_tokens": m.capacity_tokens,
            "prefix_hit_rate": m.prefix_hit_rate,
            "prefix_queries_tokens": m.prefix_queries,
            "prefix_hits_tokens": m.prefix_hits,
            "preemptions": s.preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "bytes_per_token": m.bytes_per_token(),
            "slot_bytes": m.slot_bytes(),
        }
