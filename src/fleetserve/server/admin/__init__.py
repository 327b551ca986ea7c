"""The operators' admin API (``/api/v1``, an admin token or the dashboard's session), its bodies
defined in ``fleetserve.adminapi``:

    routes        build_admin_router: the routers below, under one prefix and one admin check
    apply         POST /apply: documents, all or nothing
    credentials   /keys, /tokens, /enrolments, /nodes/NAME/approve
    catalog       /classes, /fabrics
    nodes         /nodes: status, cordon, uncordon, drain, delete
    models        /models, and their files uploaded for agents
    deployments   /deployments (status, undo, explain), /decisions
    replicas      /replicas: status, logs, engine metrics
    records       /usage and /events (the audit log), with ``audit`` and ``retention``
    ui            the web dashboard and its login (``loginthrottle``)
"""
