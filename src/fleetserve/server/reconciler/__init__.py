"""The reconciler: the loop around the pure core (``loop``), run in a process of its own on
PostgreSQL (``process``), and what the autoscaler sees (``signals``)."""
