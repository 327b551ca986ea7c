"""The inventory of nodes, devices and allocations, behind one interface the stores implement
(``base``, ``memory``), and the shared hardware domain: the facts drivers report (``hardware``)
and how they are matched onto device classes and fabrics (``matching``)."""
