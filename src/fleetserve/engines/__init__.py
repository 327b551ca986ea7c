"""Inference engines: what each can do (capabilities) and, later, how to launch it (adapters)."""
