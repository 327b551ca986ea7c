"""The control plane: the REST admin API and the agents' API, the reconciler loop, the observer,
and how a process (``fleetserve server`` or ``fleetserve gateway``) is assembled (``process``)."""
