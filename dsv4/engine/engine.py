"""The synchronous engine: requests in, one scheduler step at a time, outputs out.

`LLMEngine.step()` = schedule -> run the model on one flat batch -> sample on the device ->
update streams (detokenise, stop strings) -> commit completed blocks to the prefix cache ->
free finished requests. The async server and the offline `LLM` both drive this loop.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import torch

from dsv4.cache.manager import KVCacheManager, plan_capacity
from dsv4.cache.storage import KVCacheStorage
from dsv4.config import EngineConfig, load_config
from dsv4.engine.cuda_graphs import DEFAULT_SIZES, REQUEST_SIZES, ROW_SIZES, DecodeGraphs, PiecewiseGraphs
from dsv4.engine.detokenizer import RequestStream, TokenBytes
from dsv4.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from dsv4.engine.request import Request
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampler import (
    Sampler,
    SamplingBatch,
    compute_prompt_logprobs,
    make_generator,
)
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import Scheduler
from dsv4.model.model import Model
from dsv4.model.tokenizer import engram_token_map, load_tokenizer
from dsv4.model.weights import load_weights

CPU_DEFAULT_KV_MEMORY = 512 << 20


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
        self.model_config = mcfg = load_config(model_dir)
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
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        step = self.runner.run(chunks)
        changed: dict[str, None] = {}
        sampling = [c.req for c in chunks if c.samples]
        for c in chunks:
            req = c.req
            if req.request_id in step.prompt_rows:
                self._prompt_logprobs(req, c, step)
            req.num_computed += c.num_tokens
            if req.num_computed <= req.prefill_target:
                self.prompt_tokens += c.num_tokens
            self.manager.commit_full_blocks(req.request_id, req.all_token_ids[: req.num_computed])
        if sampling:
            self._sample(sampling, step)
            for req in sampling:
                changed[req.parent_id] = None
        return [self._output(pid) for pid in changed]

    def _sample(self, reqs: list[Request], step) -> None:
        rows = torch.tensor([step.sample_rows[r.request_id] for r in reqs], device=step.logits.device)
        logits = step.logits[rows]
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
        out = self.sampler.sample(logits, batch)
        tokens = out.sampled_token_ids.tolist()
        now = time.monotonic()
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.output_token_ids.append(tok)
            self.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            if req.params.logprobs is not None and out.logprobs is not None:
                n = req.params.logprobs
                ids = out.logprobs.token_ids[i].tolist()
                vals = out.logprobs.logprobs[i].tolist()
                req.logprobs.append(TokenLogprob(tok, vals[0], int(out.logprobs.ranks[i]), list(zip(ids[1 : 1 + n], vals[1 : 1 + n]))))
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

    def _prompt_logprobs(self, req: Request, chunk, step) -> None:
        first, count = step.prompt_rows[req.request_id]
        targets = torch.tensor(req.prompt_token_ids[chunk.start + 1 : chunk.start + 1 + count], device=step.logits.device)
        lp = compute_prompt_logprobs(step.logits[first : first + count], targets, req.params.prompt_logprobs)
        n = req.params.prompt_logprobs
        for i in range(count):
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
