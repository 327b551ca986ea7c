"""The declarative resources an operator writes (YAML or the API), validated with pydantic v2.

- ``base``: the ``Spec`` base every document part derives from (frozen, camelCase, closed) and the
  field types they share (``Name``, ``Bytes``, the bounds);
- ``resources``: the kinds themselves: ``DeviceClass``, ``Fabric``, ``Node``, ``Model``,
  ``Deployment`` (with its profiles) and ``Replica``, and their states;
- ``nodeparts``: what a ``Node`` is made of: devices and their health, HCAs, CPU capacity, a cordon;
- ``policies``: a deployment's replica range, routing, admission, rollout and autoscaling;
- ``cluster``: the ``Cluster`` kind, a Kubernetes cluster replicas are rendered into;
- ``loader``: multi-document YAML into these, every problem reported at once.
"""
