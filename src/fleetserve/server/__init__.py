"""The control plane: REST admin API, state store, reconciler loop."""
