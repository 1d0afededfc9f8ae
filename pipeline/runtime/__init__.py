"""The runtime: the supervisor and its stage processes, the in-process loop, the wiring
of rings and shared tables between stages, and what a dead stage leaves behind."""
