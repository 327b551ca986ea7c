"""The node agent: hardware discovery, the model cache, engine supervision and status reports."""
