"""OpenAI-compatible serving layer: prompt encoding, output parsing and the HTTP API."""
