"""DeepSeek-V4.1-Flash / V4-Flash model side: checkpoint inventory (`spec`), number formats
(`quant`), weight loading (`weights`), tokenizer and engram vocabulary map (`tokenizer`), and
tiny random checkpoints in the release format for tests (`make_tiny`)."""
