"""The agents' API (``/api/v1/agent``, a node's credential; the join token only enrols).

    door          heartbeat, status report, assignments poll: ONE raw-ASGI handler each, before
                  FastAPI, every refusal included
    refusals      the one table of problems the door answers (401, 403, 404, 405, 409, 413, 422)
    parse         a JSON body as a protocol model; the poll's query (its bounds, once)
    reporting     a status report as the store takes it; its GPU samples must be its own
    assignments   a node's assignment set and its revision
    assignwatch   held polls woken by one store read per tick
    batching      concurrent calls of a kind gathered into one store call
    routes        the FastAPI routes: register, classes, model documents and files
    enrolment     who may enrol, from which address
    limits        body limits per call (and the FastAPI routes' middleware)
    modelfiles    the model files agents fetch
    openapi       the door's calls in the OpenAPI document

What the door accepts is the store's one rule (``store/acceptance.py``).
"""
