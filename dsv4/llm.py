"""Offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))` and exact prompt logits."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from dsv4.engine.engine import LLMEngine
from dsv4.engine.outputs import RequestOutput
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import Chunk


class LLM:
    """Engine options are keyword arguments with vLLM's names (see EngineConfig)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str = "float32", **engine_options):
        self.engine = LLMEngine(model_dir, device=device, dtype=dtype, **engine_options)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a token-id list, or a list of token-id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params: expected {len(prompts)} entries (one per prompt), got {len(params_list)}")
        order = []
        try:
            for prompt, p in zip(prompts, params_list):
                rid = f"gen-{next(self._ids)}"
                if isinstance(prompt, str):
                    ids = self.tokenizer.encode(prompt, add_bos=True)
                    self.engine.add_request(rid, ids, p, prompt=prompt)
                else:
                    self.engine.add_request(rid, list(prompt), p)
                order.append(rid)
        except ValueError:  # one bad prompt: nothing of this call stays queued
            for rid in order:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), disable=not use_tqdm) as bar:
            task = bar.add_task("generate", total=len(order), rate="")
            start_tokens = self.engine.generation_tokens
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.advance(task)
                elapsed = bar.tasks[0].elapsed or 1e-9
                bar.update(task, rate=f"{(self.engine.generation_tokens - start_tokens) / elapsed:.1f} tok/s")
        return [results[rid] for rid in order]

    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits [len(prompt), vocab] at every prompt position: one exact forward (every
        layer on every token, no prefix cache) over all prompts as one ragged batch."""
        eng = self.engine
        reqs = []
        for ids in prompts:
            if not ids:
                raise ValueError("prompts: every prompt needs at least one token")
            if len(ids) > eng.max_model_len:
                raise ValueError(f"prompts: {len(ids)} tokens exceed max_model_len {eng.max_model_len}")
            rid = f"logits-{next(self._ids)}"
            req = Request(rid, rid, 0, list(ids), SamplingParams(max_tokens=1), stream=None)
            reqs.append(req)
        out: list[torch.Tensor] = []
        held = []
        try:
            for req in reqs:
                held.append(req.request_id)
                req.slot = eng.manager.allocate_slot(req.request_id)
                eng.manager.get_computed_blocks(req.request_id, [])
                if req.slot is None or not eng.manager.allocate_for(req.request_id, len(req.prompt_token_ids)):
                    raise RuntimeError("prompt_logits: the KV cache cannot hold these prompts at once; pass fewer")
            chunks = [Chunk(r, 0, len(r.prompt_token_ids)) for r in reqs]
            batch, _, _ = eng.runner.build_batch(chunks)
            batch.decoder_tokens = None
            batch.logits_rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
            hidden = eng.model.forward(batch, eng.storage)
            logits = eng.model.logits(hidden)
            for b, r in enumerate(reqs):
                out.append(logits[batch.offsets[b] : batch.offsets[b + 1]].cpu())
        finally:
            for rid in held:
                eng.manager.free(rid)
        return out

    def cache_stats(self) -> dict:
        return self.engine.stats()
