"""Placement: a pure function of (deployment, inventory snapshot) to a decision or an explanation."""
