"""The ``fleetserve`` command line."""
