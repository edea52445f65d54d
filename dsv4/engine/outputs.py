"""What the engine returns per request (vLLM's shapes, so offline users feel at home)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # the whole completion so far (stop text excluded)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    # incremental view for streaming: what this step added
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt: str | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    # single-sample conveniences (n == 1), as `LLM.generate` users expect
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text
