"""dsv4: inference and serving engine for DeepSeek-V4.1-Flash and DeepSeek-V4-Flash."""

__version__ = "0.1.0"
