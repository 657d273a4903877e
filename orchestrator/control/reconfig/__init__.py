"""Reconfiguring: the one carrier and its kinds (a repair, a phase switch, a grow)."""
