"""The inventory of nodes, devices and allocations, behind one interface the stores implement."""
