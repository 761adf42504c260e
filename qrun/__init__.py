"""qrun: quantized LLM inference runtime."""
