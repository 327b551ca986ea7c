"""The operators' admin API (``/api/v1``), defined once: every body the control plane's admin routes
(``server/admin/``) take and answer, imported by those routes and by the CLI that reads them
(``cli/``), as ``protocol.py`` is for the agents' API. The dashboard's scripts read the same names
(a test holds them to these models).

    values        View (the base: camelCase on the wire), IsoTime, Deleted, Revoked, extend
    fleet         nodes, device classes, fabrics, models, deployments, replicas, apply
    credentials   gateway API keys, admin and join tokens, node enrolments
    records       usage and the audit log

Field names on the wire are camelCase (``createdAt``, ``lastHeartbeat``); times are ISO 8601 as
``datetime.isoformat`` writes them. Resources are the documents of ``spec/resources.py`` with what
the server adds (a node's ``status``, a deployment's ``generation``); a deployment's status and its
decisions are ``spec/status.py``'s.
"""
