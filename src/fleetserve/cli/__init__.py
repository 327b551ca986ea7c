"""The ``fleetserve`` command line: one typer app (``main``), a module per group of commands.

- ``main``: the app and its command table, ``plan`` and ``dev tiny-model``; ``plan``: the
  offline placement it runs;
- ``serve``: ``server``, ``gateway`` and ``up``; ``agent``: the ``agent`` command's flags,
  ``agent_cmd``: the agent it runs; ``options``: the flags these process commands share;
  ``local``: ``up``'s and ``dev tiny-model``'s work on this machine;
- ``admin``: the commands that talk to a running control plane (``apply``, ``get``, ``drain``,
  ...); ``records``: ``usage`` and ``events``; ``views``: how they show API objects;
  ``client``: how they reach the server; ``output``: tables, JSON and YAML;
- ``kube``: the ``kube`` group (Kubernetes instead of node agents).
"""
