"""What the tests and the benchmarks share, as numpy.testing is to numpy: a worker
serving in a thread with the configurations they run it with (workers.py), pixels and
the sim tower's rows computed independently of the tower (sim.py), and the chaos
harness (chaos/). Nothing of the worker itself imports this package."""
