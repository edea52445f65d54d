"""Batched token sampling on the logits' device.

One ``Sampler.sample`` call turns the last-position logits of every running request
into one token per request. All per-request settings are packed once per step into a
``SamplingBatch`` of [B] tensors, so the work is a fixed sequence of batched tensor
ops whatever the mix of requests; nothing loops over the vocabulary in Python.

Processing order (each step only runs if some row needs it):

1. allowed-token mask and additive logit bias (structured output, logit_bias);
2. ``min_tokens``: eos/stop tokens get -inf while a request is still too short;
3. penalties with vLLM semantics: the repetition penalty covers tokens seen in the
   prompt or output (positive logits divided, non-positive multiplied); presence and
   frequency penalties subtract per output-token occurrence;
4. greedy rows (temperature 0) take the argmax of these penalised logits;
5. other rows: divide by temperature, keep top-k, then the top-p nucleus (of the
   top-k-renormalised distribution), then drop tokens below ``min_p * max_prob``,
   and draw from what is left.

Drawing uses the exponential race: ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)`` picks
``i`` with probability ``p_i``. The noise of a seeded request comes from that request's
own ``torch.Generator`` and the processing is row-wise, so a seeded request yields the
same tokens whatever else shares the batch and wherever its row sits.

Logprobs are "raw", as in vLLM's default: ``log_softmax`` of the model's logits before
any masking, penalty, temperature or truncation, i.e. what the model itself assigns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4.engine.sampling_params import SamplingParams

# Rows of prompt logits turned into log-probs at a time, bounding the [chunk, V] temporary.
PROMPT_LOGPROBS_CHUNK = 512


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator a seeded request keeps for its whole life (its state advances per step)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class LogprobsTensors:
    """Logprobs of chosen tokens plus the top-N alternatives, per row.

    Column 0 of ``token_ids``/``logprobs`` is the chosen token; columns 1..N are the N
    most likely tokens, best first. ``ranks`` is the chosen token's 1-based rank
    (1 + the number of tokens strictly more likely). A row that asked for fewer
    alternatives than the batch maximum uses only its first ``1 + n`` columns.
    """

    token_ids: Tensor  # [T, 1 + N] int64
    logprobs: Tensor  # [T, 1 + N] float32
    ranks: Tensor  # [T] int64


@dataclass
class SamplerOutput:
    sampled_token_ids: Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


@dataclass
class SamplingBatch:
    """Per-step sampling state of B requests, as tensors on the logits' device.

    Build it with ``SamplingBatch.build``. Optional tensors are None when no row needs
    that step, which lets the sampler skip it.
    """

    temperature: Tensor  # [B] float32; 1.0 on greedy rows so the division is harmless
    greedy: Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool
    top_k: Tensor | None  # [B] int64; vocab size where disabled
    top_p: Tensor | None  # [B] float32; +inf where disabled (1.0 could drop float-rounding tails)
    min_p: Tensor | None  # [B] float32
    repetition_penalty: Tensor | None  # [B] float32
    presence_penalty: Tensor | None  # [B] float32
    frequency_penalty: Tensor | None  # [B] float32
    # Token ids padded with the vocab size (an index past the real vocab, dropped after
    # scattering): prompt ids only for the repetition penalty, output ids for all penalties.
    prompt_token_ids: Tensor | None  # [B, Lp] int64
    output_token_ids: Tensor | None  # [B, Lo] int64
    generators: dict[int, torch.Generator]  # row -> generator of seeded, non-greedy rows
    # (row, token) pairs to forbid this step because of min_tokens.
    suppress_rows: Tensor | None  # [K] int64
    suppress_token_ids: Tensor | None  # [K] int64
    allowed_token_mask: Tensor | None  # [B, V] bool, True = may be sampled
    logit_bias: Tensor | None  # [B, V] float32, added to the logits
    max_num_logprobs: int | None  # most alternatives any row asked for; None = no logprobs

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str,
        prompt_token_ids: Sequence[Sequence[int] | Tensor],
        output_token_ids: Sequence[Sequence[int] | Tensor],
        generators: Sequence[torch.Generator | None] | None = None,
        eos_token_id: int | None = None,
        allowed_token_masks: Tensor | Sequence[Tensor | None] | None = None,
        logit_bias: Tensor | None = None,
    ) -> SamplingBatch:
        """Pack B requests for one step.

        ``generators[i]`` is request i's generator from ``make_generator`` (None when it
        has no seed). ``allowed_token_masks`` is either a [B, V] bool tensor or one [V]
        bool tensor (or None = everything allowed) per row.
        """
        batch_size = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == batch_size):
            raise ValueError("params, prompt_token_ids and output_token_ids must have one entry per row")

        def column(values: list, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        greedy_list = [p.is_greedy for p in params]
        greedy = column(greedy_list, torch.bool)
        temperature = column([1.0 if g else p.temperature for p, g in zip(params, greedy_list)])

        top_k = top_p = min_p = None
        if any(p.top_k_enabled for p in params):
            top_k = column([p.top_k if p.top_k_enabled else vocab_size for p in params], torch.int64)
        if any(p.top_p < 1.0 for p in params):
            top_p = column([p.top_p if p.top_p < 1.0 else float("inf") for p in params])
        if any(p.min_p > 0.0 for p in params):
            min_p = column([p.min_p for p in params])

        repetition = presence = frequency = None
        padded_prompt = padded_output = None
        if any(p.repetition_penalty != 1.0 for p in params):
            repetition = column([p.repetition_penalty for p in params])
            padded_prompt = _pad_token_ids(prompt_token_ids, vocab_size, device)
        if any(p.presence_penalty != 0.0 for p in params):
            presence = column([p.presence_penalty for p in params])
        if any(p.frequency_penalty != 0.0 for p in params):
            frequency = column([p.frequency_penalty for p in params])
        if repetition is not None or presence is not None or frequency is not None:
            padded_output = _pad_token_ids(output_token_ids, vocab_size, device)

        seeded: dict[int, torch.Generator] = {}
        if generators is not None:
            seeded = {
                row: gen
                for row, gen in enumerate(generators)
                if gen is not None and not greedy_list[row]
            }

        suppress_rows: list[int] = []
        suppress_ids: list[int] = []
        for row, (p, out) in enumerate(zip(params, output_token_ids)):
            if len(out) < p.min_tokens:
                stop_ids = set(p.stop_token_ids)
                if eos_token_id is not None and not p.ignore_eos:
                    stop_ids.add(eos_token_id)
                suppress_rows += [row] * len(stop_ids)
                suppress_ids += sorted(stop_ids)

        allowed = None
        if isinstance(allowed_token_masks, Tensor):
            allowed = allowed_token_masks.to(device)
        elif allowed_token_masks is not None and any(m is not None for m in allowed_token_masks):
            allowed = torch.ones(batch_size, vocab_size, dtype=torch.bool, device=device)
            for row, mask in enumerate(allowed_token_masks):
                if mask is not None:
                    allowed[row] = mask.to(device)

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            greedy=greedy,
            all_greedy=all(greedy_list),
            any_greedy=any(greedy_list),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_token_ids=padded_prompt,
            output_token_ids=padded_output,
            generators=seeded,
            suppress_rows=column(suppress_rows, torch.int64) if suppress_rows else None,
            suppress_token_ids=column(suppress_ids, torch.int64) if suppress_ids else None,
            allowed_token_mask=allowed,
            logit_bias=None if logit_bias is None else logit_bias.to(device, torch.float32),
            max_num_logprobs=max(requested) if requested else None,
        )


def _pad_token_ids(
    seqs: Sequence[Sequence[int] | Tensor], pad_id: int, device: torch.device | str
) -> Tensor:
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    for row, seq in enumerate(seqs):
        if len(seq):
            out[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.int64)
    return out.to(device, non_blocking=True)


class Sampler:
    """Stateless apart from the generator shared by all unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        # None = the device's default generator (torch.manual_seed governs it).
        self.generator = generator

    def sample(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Pick one token per row of ``logits`` [B, V] (float32; other dtypes are upcast)."""
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        logits = self.apply_constraints_and_penalties(logits, batch)

        if batch.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            probs = self.filtered_probs(logits / batch.temperature.unsqueeze(1), batch)
            sampled = self._exponential_race(probs, batch.generators)
            if batch.any_greedy:
                sampled = torch.where(batch.greedy, logits.argmax(dim=-1), sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def apply_constraints_and_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
        """Steps 1-3 of the module docstring, on a float32 copy (the input is left intact)."""
        logits = logits.to(torch.float32, copy=True)
        if batch.allowed_token_mask is not None:
            logits.masked_fill_(~batch.allowed_token_mask, float("-inf"))
        if batch.logit_bias is not None:
            logits += batch.logit_bias
        if batch.suppress_rows is not None:
            logits[batch.suppress_rows, batch.suppress_token_ids] = float("-inf")

        batch_size, vocab_size = logits.shape
        if batch.repetition_penalty is not None:
            # One spare column absorbs the padding index, then is cut off.
            seen = torch.zeros(batch_size, vocab_size + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, batch.prompt_token_ids, True)
            seen.scatter_(1, batch.output_token_ids, True)
            penalty = torch.where(seen[:, :vocab_size], batch.repetition_penalty.unsqueeze(1), 1.0)
            logits = torch.where(logits > 0, logits / penalty, logits * penalty)
        if batch.presence_penalty is not None or batch.frequency_penalty is not None:
            ids = batch.output_token_ids
            counts = torch.zeros(batch_size, vocab_size + 1, dtype=torch.float32, device=logits.device)
            counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=ids.device))
            counts = counts[:, :vocab_size]
            if batch.frequency_penalty is not None:
                logits -= batch.frequency_penalty.unsqueeze(1) * counts
            if batch.presence_penalty is not None:
                logits -= batch.presence_penalty.unsqueeze(1) * (counts > 0)
        return logits

    @staticmethod
    def filtered_probs(scaled_logits: Tensor, batch: SamplingBatch) -> Tensor:
        """Step 5 without the draw: the distribution each row samples from (rows sum to 1)."""
        logits = scaled_logits
        if batch.top_k is not None or batch.top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            if batch.top_k is not None:
                positions = torch.arange(logits.shape[1], device=logits.device)
                sorted_logits.masked_fill_(positions >= batch.top_k.unsqueeze(1), float("-inf"))
            if batch.top_p is not None:
                # Keep a token while the mass strictly before it is < top_p: the smallest
                # prefix of the sorted distribution reaching top_p (never empty).
                sorted_probs = sorted_logits.softmax(dim=-1)
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
                sorted_logits.masked_fill_(mass_before >= batch.top_p.unsqueeze(1), float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if batch.min_p is not None:
            # Relative to the row's top probability, so unaffected by the renormalisation
            # that top-k/top-p imply.
            threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def _exponential_race(self, probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        # Seeded rows overwrite their share with draws from their own generator.
        for row, generator in generators.items():
            noise[row].exponential_(generator=generator)
        # A zero draw would turn p/E into inf (or NaN for p == 0) and win the argmax.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)


def gather_logprobs(logprobs: Tensor, token_ids: Tensor, num_top: int) -> LogprobsTensors:
    """Chosen-token logprob and rank plus the ``num_top`` best alternatives, per row of [T, V]."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    ids = token_ids.unsqueeze(1)
    values = chosen
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        ids = torch.cat([ids, top_ids], dim=1)
        values = torch.cat([values, top_values], dim=1)
    return LogprobsTensors(token_ids=ids, logprobs=values, ranks=ranks)


def compute_prompt_logprobs(logits: Tensor, target_token_ids: Tensor, num_top: int) -> LogprobsTensors:
    """Raw logprobs of prompt tokens from the logits that predicted them.

    ``logits[i]`` is the model output at some prompt position and ``target_token_ids[i]``
    the prompt token that follows it; for a whole prompt that is ``logits[:-1]`` against
    ``prompt[1:]`` (the first prompt token has no logprob). Chunked prefill can call this
    per chunk with the targets shifted accordingly.
    """
    if logits.shape[0] != target_token_ids.shape[0]:
        raise ValueError(
            f"target_token_ids: need one per logits row ({logits.shape[0]}), got {target_token_ids.shape[0]}"
        )
    parts = []
    for start in range(0, logits.shape[0], PROMPT_LOGPROBS_CHUNK):
        stop = start + PROMPT_LOGPROBS_CHUNK
        chunk_logprobs = torch.log_softmax(logits[start:stop].float(), dim=-1)
        parts.append(gather_logprobs(chunk_logprobs, target_token_ids[start:stop], num_top))
    if not parts:
        empty = torch.empty(0, 1 + num_top, device=logits.device)
        return LogprobsTensors(empty.long(), empty, torch.empty(0, dtype=torch.int64, device=logits.device))
    return LogprobsTensors(
        token_ids=torch.cat([p.token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        ranks=torch.cat([p.ranks for p in parts]),
    )
