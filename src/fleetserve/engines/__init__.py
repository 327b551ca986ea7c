"""Inference engines, one module and one row each (``llamacpp``, ``vllm``), listed by ``registry``;
``spec`` is the rows shape, launch the launch specs the rows adapters build, ``binaries`` where
an agent finds each binary."""
