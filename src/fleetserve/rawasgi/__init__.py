"""Raw ASGI: the few pieces a request handler needs when it answers without a framework.

Used by the gateway's data path (``gateway/app.py``, ``gateway/asgi.py``) and the agents' fast
path (``server/agents/door.py``), where FastAPI costs more CPU than the call itself. It imports
nothing of fleetserve but ``errors``: it sits below both of its users.

- ``types``: ``Scope``, ``Message``, ``Receive``, ``Send``, ``App``, ``Header``, the ASGI aliases.
- ``headers``: a header's value by name; the token of ``Authorization: Bearer T``.
- ``body``: the declared Content-Length of a JSON body; ONE bounded body reader, whose result
  tells a complete body (``bytes``) from one over the limit or a client gone (``Unread``).
- ``disconnect``: waiting for ``http.disconnect``; running work that is cancelled when the client
  leaves (``unless_gone``, raising ``ClientGone``).
- ``answers``: sending a whole response (status, headers, body and its Content-Length; JSON by
  default).
"""
