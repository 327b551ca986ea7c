"""Developer tools: the tiny test model."""
