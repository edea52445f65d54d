"""`dsv4 bench`: AgentX-style closed-loop serving benchmark for any OpenAI-compatible server.

The field judges DeepSeek-V4(.1)-Flash serving on agentic-coding replay (SemiAnalysis
AgentX): long cached prefixes, small incremental prefills, short decodes, reported as a
Pareto frontier of total tok/s/GPU vs P90 E2E-normalised interactivity. This package
reproduces that protocol (BENCH.md sections 1.5 and 5) without external data:

* `workloads` - deterministic AgentX-synth sessions, Weka trace replay, random prompts;
* `replay` - lanes, warm start, think times, recycling, measurement window, HTTP client;
* `metrics` - the metric arithmetic (throughput, TTFT, ITL/TPOT, interactivity);
* `report` - console table, JSONL, Pareto frontier, iso-interactivity, PNG plot;
* `cli` - the `bench serve` and `bench plot` subcommands.
"""
