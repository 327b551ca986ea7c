"""fleetserve: serve open-weight LLMs on a fleet of NVIDIA, AMD and CPU machines."""

__version__ = "0.1.0"
