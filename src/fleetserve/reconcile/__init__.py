"""The reconciler: desired state against actual, through placement. Pure core here; I/O in the server."""
