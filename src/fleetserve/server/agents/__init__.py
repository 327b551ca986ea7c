"""The agents' API (``/agent/v1``, a node's credential; the join token only enrols): enrolment
(``enrolment``), the routes (``routes``), the hot calls answered before FastAPI (``hotpath``,
gathered by ``batching``, polls woken by ``assignwatch``), body limits (``limits``) and the model
files agents fetch (``modelfiles``)."""
