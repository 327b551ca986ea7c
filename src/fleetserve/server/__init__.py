"""The control plane, by who it serves.

::

    server/
      admin/        the operators' API under /api/v1: routes by resource, apply, records, the
                    dashboard (/ui), the audit log and its retention
      agents/       the agents' API under /agent/v1: enrolment, the hot calls (heartbeat, status,
                    assignments long-poll), model files
      reconciler/   the reconcile loop, its own process, the autoscaler's signals
      app.py        the HTTP apps assembled from the three (and the gateway's /v1)
      process.py    how a process (``fleetserve server``, ``fleetserve gateway``) is wired and run
      auth.py       credentials for every caller, checked before a body is read
      problems.py   errors as HTTP answers, one body shape
      params.py     typed path and query parameters
      observer.py   the engines' metrics, scraped for /metrics, the picker and the autoscaler
      collector.py  the garbage collector's settings for the server process
"""
