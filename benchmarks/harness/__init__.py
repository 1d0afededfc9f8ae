"""What the benchmark scripts share: the client process (gateway and receiver,
client.py), the worker process and its CPU and memory accounting (worker.py), a fresh
worker with its client and the paired runs of two (session.py), the baselines measured
in child processes (baselines.py), and the figures' arithmetic, printing and JSON
(report.py). The worker itself and what the tests share too come from pipeline/ and
pipeline/testing."""
