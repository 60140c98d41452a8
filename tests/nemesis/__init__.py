"""Fault injection for nemesis tests: a TCP proxy whose faults switch while traffic flows."""
